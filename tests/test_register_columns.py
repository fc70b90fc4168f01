"""The register-column split and join shared by the Sinkhorn and segment kernels."""
import pytest
import torch
import triton
import triton.language as tl

from packed_kernels import runtime  # noqa: F401  (interpret or compile, before the kernels below)
from packed_kernels.device_functions.register_columns import join_columns, load_lane_rows, split_columns


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


@triton.jit
def _lane_rows_kernel(x_ptr, base_ptr, out_ptr, n, other, ROWS: tl.constexpr, LANES: tl.constexpr,
                      BITS: tl.constexpr, VECTOR: tl.constexpr):
    """Entry ``r`` of lane ``t`` of :func:`load_lane_rows` to ``out[r, t]``."""
    lanes = tl.arange(0, LANES)
    rows = load_lane_rows(x_ptr, tl.load(base_ptr + lanes), n, other, ROWS, LANES, BITS, VECTOR)
    for r in tl.static_range(ROWS):
        tl.store(out_ptr + r * LANES + lanes, rows[r])


LANE_ROWS_CASES = [
    # (rows, lanes, vector): the 16-byte loads need compiled code and rows a multiple of 4
    (4, 8, False), (1, 16, False), (8, 4, False), (2, 32, False),
    pytest.param(4, 8, True, marks=pytest.mark.gpu_only), pytest.param(8, 4, True, marks=pytest.mark.gpu_only),
]


@pytest.mark.parametrize("rows,lanes,vector", LANE_ROWS_CASES, ids=lambda v: str(v))
def test_load_lane_rows_reads_each_lanes_rows_and_other_from_n_on(rows, lanes, vector, device):
    """Lane ``t`` gets ``x[base[t] + r]`` for ``r < ROWS``, and ``other`` from index ``n`` on,
    although the buffer goes on beyond ``n`` (with values that must not be read)."""
    g = torch.Generator().manual_seed(rows * lanes)
    base = (torch.randperm(lanes, generator=g) * max(rows, 4)).to(torch.int32)  # lanes in any order
    n = int(base.max()) + rows // 2  # the rows of the lane that starts last straddle n
    x = torch.cat([torch.randn(n, generator=g), torch.full((4 * lanes * rows,), 1e30)])  # beyond n: not data
    out = torch.full((rows, lanes), float("nan"))
    x, base_d, out = x.to(device), base.to(device), out.to(device)
    _lane_rows_kernel[(1,)](x, base_d, out, n, -7.0, ROWS=rows, LANES=lanes, BITS=rows.bit_length() - 1,
                            VECTOR=vector)
    index = base[None, :].long() + torch.arange(rows)[:, None]
    expected = torch.where(index < n, x.cpu()[index.clamp(max=n - 1)], torch.tensor(-7.0))
    assert torch.equal(out.cpu(), expected)
    assert bool((index >= n).any()) and bool((index < n).any()), "the case covers both sides of n"
