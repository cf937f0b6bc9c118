"""The embedded engine's linear layers for a few rows on a CPU (`engine.cpu_linear`)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from agentcache.engine.cpu_linear import SMALL_ROWS, RowsFirstLinear, use_rows_first_linear


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, SMALL_ROWS, SMALL_ROWS + 1, 200])
def test_rows_first_linear_equals_f_linear_for_any_number_of_rows(rows: int, bias: bool):
    torch.manual_seed(rows)
    layer = nn.Linear(96, 160, bias=bias)
    x = torch.randn(rows, 1, 96)  # [batch, 1, in]: a decode step's shape
    expected = F.linear(x, layer.weight, layer.bias)
    use_rows_first_linear(layer)
    assert type(layer) is RowsFirstLinear
    with torch.inference_mode():
        got = layer(x)
    assert got.shape == (rows, 1, 160) and got.dtype == torch.float32 and got.is_contiguous()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_only_plain_float32_cpu_linears_are_swapped_and_the_parameters_stay():
    class Scaled(nn.Linear):  # a subclass has a forward of its own: left alone
        pass

    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8).to(torch.bfloat16), Scaled(8, 8), nn.Embedding(4, 8))
    weight = model[0].weight
    assert use_rows_first_linear(model) == 1
    assert [type(m).__name__ for m in model] == ["RowsFirstLinear", "Linear", "Scaled", "Embedding"]
    assert model[0].weight is weight  # the same parameter, not a copy
    assert use_rows_first_linear(model) == 0  # once is enough
    empty = torch.zeros(0, 8)
    assert model[0](empty).shape == (0, 8)
