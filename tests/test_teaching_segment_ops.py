"""The segment chapter's teaching kernel (one program per segment) against the float64
NumPy stage: fresh random layouts, and the edge cases a segmented sum trips over (empty
segments at the start, middle and end, segments of one row, segments longer than a block
of rows, more columns than a block of columns, no rows at all)."""
import numpy as np
import pytest
import torch

from packed_kernels.ops.segment import naive_numpy, teaching

from assertions import assert_close


def reference(x: np.ndarray, idx: np.ndarray, num_segments: int) -> np.ndarray:
    """The NumPy stage's sum, for rows of any trailing shape."""
    rows = x.reshape(len(idx), -1)
    out = naive_numpy.segmented_sum_numpy(rows, idx, num_segments)
    return out.reshape((num_segments,) + x.shape[1:])


def check(lengths, trailing_empty, row_shape, device, dtype=torch.float64, idx_dtype=torch.int32,
          block_rows=4, seed=0):
    rng = np.random.default_rng(seed)
    num_segments = len(lengths) + trailing_empty
    idx = np.repeat(np.arange(len(lengths)), lengths)
    x = rng.standard_normal((len(idx),) + row_shape)
    got = teaching.segmented_sum_teaching(torch.tensor(x, dtype=dtype, device=device),
                                          torch.tensor(idx, dtype=idx_dtype, device=device),
                                          num_segments, block_rows=block_rows)
    assert got.dtype == dtype and got.shape == (num_segments,) + row_shape
    want = torch.tensor(reference(x, idx, num_segments))
    tolerance = 1e-12 if dtype == torch.float64 else 1e-5
    assert_close("segmented_sum_teaching", got.cpu().double(), want, atol=tolerance, rtol=tolerance)


# (lengths, empty segments after the last index); blocks of 4 rows, so a length of 9
# takes three blocks, the last one partly masked.
LAYOUTS = {
    "empty-first-middle-last": ([0, 3, 0, 9, 1, 4], 2),
    "one-row-segments": ([1, 1, 1, 1, 1], 0),
    "one-long-segment": ([37], 0),
    "exact-blocks": ([4, 8, 4], 1),
}


@pytest.mark.parametrize("row_shape", [(), (3,), (2, 5)], ids=["N", "N-3", "N-2-5"])
@pytest.mark.parametrize("layout", list(LAYOUTS), ids=list(LAYOUTS))
def test_edge_layouts_match_numpy(layout, row_shape, device):
    lengths, trailing = LAYOUTS[layout]
    check(lengths, trailing, row_shape, device)


@pytest.mark.parametrize("seed", range(4))
def test_random_layouts_match_numpy(seed, device):
    rng = np.random.default_rng(100 + seed)
    lengths = rng.integers(0, 20, rng.integers(1, 12)).tolist()
    width = int(rng.integers(1, 7))
    check(lengths, int(rng.integers(0, 3)), (width,), device, block_rows=int(rng.choice([4, 8, 32])),
          seed=seed)


def test_more_columns_than_a_block(device):
    # 300 columns: three programs per segment along the columns, the last one masked
    check([2, 0, 5], 1, (300,), device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_lower_precision_sums_in_float32(dtype, device):
    lengths = [3, 0, 6]
    idx = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths)).to(device)
    x = torch.randn(len(idx), 3, device=device).to(dtype)
    got = teaching.segmented_sum_teaching(x, idx, 4)
    want = reference(x.double().cpu().numpy(), idx.cpu().numpy(), 4)
    assert got.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert_close("segmented_sum_teaching", got.cpu().double(), torch.tensor(want), atol=tolerance,
                 rtol=tolerance)


def test_int64_idx(device):
    check([2, 5, 0, 1], 0, (3,), device, idx_dtype=torch.int64)


def test_no_rows_gives_zeros(device):
    x = torch.zeros(0, 3, dtype=torch.float64, device=device)
    idx = torch.zeros(0, dtype=torch.int32, device=device)
    assert torch.equal(teaching.segmented_sum_teaching(x, idx, 3).cpu(), torch.zeros(3, 3, dtype=torch.float64))
    assert teaching.segmented_sum_teaching(x, idx, 0).shape == (0, 3)


def test_offsets_are_the_segments_cu_seqlens(device):
    idx = torch.tensor([1, 1, 3, 3, 3], dtype=torch.int32, device=device)
    assert teaching.segment_offsets(idx, 5).tolist() == [0, 0, 2, 2, 5, 5]
