"""A vLLM logits processor that records each flagged request's logits at its last prompt position.

vLLM's sampler runs non-argmax-invariant processors on the raw float32 logits of every request in
the batch before penalties and temperature (agentcache never sets logit bias, bad words or minimum
tokens, so the row is the model's own). A chunked prefill also yields a row for each partial
chunk; the row is overwritten until the first token is out, which leaves the last prompt position's.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

from agentcache.engine.vllm.registry import REGISTRY, WORKER_LOGITS, key_of

__all__ = ["LastPromptLogits"]


def _first_rank() -> bool:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank() == 0


class LastPromptLogits(LogitsProcessor):
    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.rows: dict[int, tuple[str, list[int]]] = {}  # batch row -> (registry key, the request's live output ids)
        # with worker processes every rank samples the same rows: the first one sends them
        self.sends = vllm_config.parallel_config.world_size == 1 or _first_rank()

    def is_argmax_invariant(self) -> bool:
        return False  # argmax-invariant processors run only for random sampling

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        def track(params: Any, prompt_ids: Any, output_ids: list[int]) -> tuple[str, list[int]] | None:
            key = key_of(params)  # a worker process has no registry: every keyed request is agentcache's
            return (key, output_ids) if key is not None else None

        process_dict_updates(self.rows, batch_update, track)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        # logits: (B, V) float32
        for row, (key, output_ids) in self.rows.items():
            if output_ids:  # past the prompt
                continue
            hooks = REGISTRY.get(key)
            if hooks is not None:
                hooks.last_logits = logits[row].detach().float().clone()
            elif self.sends:  # a worker process: the connector sends it back with the next step
                WORKER_LOGITS[key] = logits[row].detach().float().clone()
        return logits
