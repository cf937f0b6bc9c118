"""Tiny random-weight test models: their configs and the byte-level tokenizer they share."""

from __future__ import annotations

from typing import Any

__all__ = ["byte_tokenizer", "chatml_tokenizer", "tiny_llama_config", "tiny_qwen2_config", "tiny_qwen2_chat_config",
           "tiny_gemma3_config", "mid_llama_config", "llama_1b_config", "TINY_CHATML_TEMPLATE"]

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


# The chat template of the tiny ChatML preset: ChatML turns, tools declared in the system turn as
# JSON lines, calls written as <tool_call>{"name", "arguments"}</tool_call> and results returned in
# <tool_response> blocks of a user turn: the layout of Qwen2.5's tool format, worded for this preset.
TINY_CHATML_TEMPLATE = (
    "{%- if messages and messages[0].role == 'system' %}"
    "{%- set system = messages[0].content %}{%- set rest = messages[1:] %}"
    "{%- else %}{%- set system = 'You are a helpful assistant.' %}{%- set rest = messages %}{%- endif %}"
    "{{- '<|im_start|>system\\n' + system }}"
    "{%- if tools %}"
    "{{- '\\n\\n# Tools\\nTo use a tool, answer with <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>. "
    "The tools:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>' }}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- for message in rest %}"
    "{%- if message.role == 'tool' %}"
    "{%- if loop.first or rest[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or rest[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}"
    "{{- '<|im_start|>assistant' }}{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for call in message.tool_calls %}"
    "{%- if call.function is defined %}{%- set call = call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + call.name + '\", \"arguments\": ' + (call.arguments | tojson) + '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
_CHATML_CONTROL = ["<|im_start|>", "<|im_end|>"]  # ids 259, 260
_CHATML_TEXT = ["<tool_call>", "</tool_call>"]  # ids 261, 262: added tokens that stay text, as in Qwen2.5


def chatml_tokenizer() -> Any:
    """The byte tokenizer with ChatML's control tokens, tool-call tags and the tool-capable chat
    template above; turns end with <|im_end|> and no BOS is used (as Qwen2.5 Instruct)."""
    from tokenizers import AddedToken

    tokenizer = byte_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": _CHATML_CONTROL})
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in _CHATML_TEXT])
    tokenizer.chat_template = TINY_CHATML_TEMPLATE
    tokenizer.bos_token = None
    tokenizer.eos_token = "<|im_end|>"
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


def tiny_llama_config() -> Any:
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


def tiny_qwen2_config() -> Any:
    from transformers import Qwen2Config

    return Qwen2Config(
        hidden_size=128, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        initializer_range=0.08, use_sliding_window=False, **_TINY_COMMON,
    )


def tiny_qwen2_chat_config() -> Any:
    """tiny-qwen2 ending turns at <|im_end|> (id 260) as well as <eos>: the tiny ChatML preset."""
    config = tiny_qwen2_config()
    config.eos_token_id = [2, 260]
    config.bos_token_id = None
    return config


def tiny_gemma3_config() -> Any:
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


def llama_1b_config() -> Any:
    from transformers import LlamaConfig

    # Random weights shaped like Llama 3.2 1B (1.1B parameters at this vocabulary): a GPU's timing model.
    return LlamaConfig(
        vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=16384,
        rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
        },
        initializer_range=0.02, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True,
    )


def mid_llama_config() -> Any:
    from transformers import LlamaConfig

    # A mid-size random model for timing benchmarks: 8 layers, hidden 512.
    return LlamaConfig(
        hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=4, head_dim=64,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        initializer_range=0.02, **_TINY_COMMON,
    )
