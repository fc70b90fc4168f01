"""The register-column split and join shared by the Sinkhorn and segment kernels."""
import pytest
import torch
import triton
import triton.language as tl

from packed_kernels import runtime  # noqa: F401  (interpret or compile, before the kernels below)
from packed_kernels.device_functions.register_columns import join_columns, split_columns


@triton.jit
def _split_then_join_kernel(x_ptr, columns_ptr, joined_ptr, ROWS: tl.constexpr, COLS: tl.constexpr,
                            BITS: tl.constexpr):
    """Column ``c`` of the tile to row ``c`` of ``columns``; the joined tile to ``joined``."""
    rows = tl.arange(0, ROWS)
    offsets = rows[:, None] * COLS + tl.arange(0, COLS)[None, :]
    columns = split_columns(tl.load(x_ptr + offsets), ROWS, COLS, BITS)
    for c in tl.static_range(COLS):
        tl.store(columns_ptr + c * ROWS + rows, columns[c] * (c + 1))  # scaled: a mixed-up column shows
    tl.store(joined_ptr + offsets, join_columns(columns, ROWS, COLS, BITS))


@pytest.mark.parametrize("rows,cols", [(16, 1), (16, 2), (32, 4), (128, 16), (64, 32)],
                         ids=lambda v: str(v))
def test_split_gives_each_column_and_join_restores_the_tile(rows, cols, device):
    x = torch.randn(rows, cols, device=device)
    columns = torch.full((cols, rows), float("nan"), device=device)
    joined = torch.full_like(x, float("nan"))
    _split_then_join_kernel[(1,)](x, columns, joined, ROWS=rows, COLS=cols, BITS=cols.bit_length() - 1)
    scale = torch.arange(1, cols + 1, device=device, dtype=x.dtype)[:, None]
    assert torch.equal(columns, x.t() * scale)
    assert torch.equal(joined, x)
