"""Linear layers for a few rows on a CPU: the weight times the rows' transpose.

A decode step multiplies every weight by one row per sequence in the batch. On this project's
2-core AMD EPYC (AVX2, torch 2.13's MKL) `F.linear` for 2 to 64 rows took up to 2.9x as long as
the same product written `(W @ x.T).T`, which MKL computes on another kernel: Qwen2.5-0.5B's
vocabulary projection for 3 rows took 182 ms against 63 ms, its MLP's up projection 4.5 ms
against 2.0 ms, and a decode step of 3 sequences ran 6.4x as long as a step of one. From a few
hundred rows on (prefill passes) the two are within 20% either way, so larger inputs keep
`F.linear`.

The engine swaps the class of a CPU float32 model's `nn.Linear` modules for `RowsFirstLinear`
(same parameters, same module tree); other devices and dtypes keep theirs, unmeasured here. Both
forms sum in float32 and differ by rounding only; a batch still decodes the tokens each of its
requests decodes alone (`tests/test_batching.py`, on real models).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["RowsFirstLinear", "SMALL_ROWS", "use_rows_first_linear"]

SMALL_ROWS = 64  # up to this many rows, (W @ x.T).T; beyond, F.linear


class RowsFirstLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = x.shape[-1]
        rows = x.numel() // features if features else 0
        if rows == 0 or rows > SMALL_ROWS:
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(rows, features)  # [rows, in]
        # [out, in] @ [in, rows] -> [rows, out], copied out of its transposed layout: in-place
        # kernels downstream (a grammar's logit mask) assume F.linear's contiguous output
        out = (self.weight @ flat.T).T.contiguous()
        if self.bias is not None:
            out.add_(self.bias)  # in the copy: no second tensor
        return out.reshape(*x.shape[:-1], self.weight.shape[0])  # [..., out]


def use_rows_first_linear(model: nn.Module) -> int:
    """Swap the class of `model`'s plain `nn.Linear` modules whose weights are float32 on a CPU;
    the number swapped."""
    swapped = 0
    for module in model.modules():
        if type(module) is nn.Linear and module.weight.device.type == "cpu" and module.weight.dtype == torch.float32:
            module.__class__ = RowsFirstLinear
            swapped += 1
    return swapped
