"""Chat-template patching: a tokenizer read from a GGUF made to say what ChatML Instruct needs."""

from __future__ import annotations

from typing import Any

from agentcache.errors import ModelLoadError

__all__ = ["as_chatml_instruct"]


def as_chatml_instruct(model: Any, tokenizer: Any) -> None:
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
