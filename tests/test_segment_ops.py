"""Segment operations: the Triton stage against the float64 NumPy loops and the padded
PyTorch stage, both derivative orders, lower precisions, launch configurations,
strides and determinism. The inputs they accept and refuse are tested in
``test_segment_inputs.py``; compile, torch.func, meta and fake tensors, opcheck, autocast
and CPU tensors on a GPU machine in ``test_segment_transforms.py``; the inputs and
references they share are in ``segment_cases.py``."""
import dataclasses
import zlib

import numpy as np
import pytest
import torch

import packed_kernels as pk
from packed_kernels import runtime
from packed_kernels.ops.segment import api, naive_numpy, padded_torch
from packed_kernels.ops.segment import triton_kernels as tk

from assertions import assert_close, unwritten_memory_is_nan
from segment_cases import (
    OPS,
    PADDED,
    PUBLIC,
    applicable,
    make_idx,
    make_inputs,
    numpy_backward,
    numpy_double_backward,
    numpy_forward,
)

# (lengths, extra empty segments after the last index): empty segments in the middle,
# at the start and at the end, length-1 segments, one single segment.
LAYOUTS = [
    ([3, 0, 5, 1, 7, 2], 2),
    ([0, 0, 4, 3], 0),
    ([1, 1, 1, 1, 1], 1),
    ([11], 0),
]
LAYOUT_IDS = ["L3-0-5-1-7-2+2", "L0-0-4-3", "L1x5+1", "L11"]
WIDTHS = [None, 3, 5]
WIDTH_IDS = ["scalar", "D3", "D5"]
#: Chunks of 4 rows for the scan kernel, and of 2 rows per lane, 8 rows (4 lanes) per
#: chunk for the in-order kernel of sum and mean, and blocks of 2 partials in the combine
#: pass: short segments lie inside a chunk (written by the first pass), long ones cross
#: chunk edges (finished by the combine pass). With the default configuration these
#: small inputs fit in one chunk.
SMALL_CHUNKS = dataclasses.replace(tk.segment_config(), chunk_elements=4, min_chunk_rows=4, rows_per_thread=2,
                                   vector_rows_per_thread=2, rows_in_order_threads=4, combine_parts=2,
                                   rowwise_elements=16)


def launched_with(config):
    """The operations (keys of PUBLIC) without the argument checks, every kernel of every
    derivative order launched with ``config``."""
    def bind(fn):
        return lambda *args: fn(*args, config=config)
    return {op: bind(api.UNCHECKED["mul" if op == "mul_broadcast" else op]) for op in PUBLIC}


IN_SMALL_CHUNKS = launched_with(SMALL_CHUNKS)


def op_widths(widths, width_ids):
    """(op, width) pairs, without the scalar rows that matvec and the broadcast mul do not take."""
    return [pytest.param(op, w, id=f"{op}-{wid}") for op in OPS for w, wid in zip(widths, width_ids)
            if applicable(op, w)]


@pytest.mark.parametrize("op, width", op_widths(WIDTHS, WIDTH_IDS))
@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_forward_and_both_derivatives_match_numpy_and_padded(layout, op, width, device):
    lengths, extra = layout
    idx = make_idx(lengths, device)
    num_segments = len(lengths) + extra
    seed = zlib.crc32(f"{op}-{width}-{lengths}".encode()) % 1000  # fixed across runs
    inputs = [t.requires_grad_() for t in make_inputs(op, idx.shape[0], num_segments, width,
                                                      torch.float64, device, seed)]
    with unwritten_memory_is_nan():  # an output entry that no kernel writes reads as NaN
        out = IN_SMALL_CHUNKS[op](*inputs, idx, num_segments)
    expected = numpy_forward(op, inputs, idx, num_segments)
    assert_close(f"{op} forward, default configuration", PUBLIC[op](*inputs, idx, num_segments), out,
                 atol=1e-12, rtol=1e-12)
    assert out.dtype == torch.float64 and out.device.type == device
    assert_close(f"{op} forward vs NumPy", out, expected, atol=1e-12, rtol=1e-12)
    assert_close(f"{op} forward vs padded", out, PADDED[op](*inputs, idx, num_segments), atol=1e-12, rtol=1e-12)

    grad = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + 1))
    grad = grad.to(device).requires_grad_()
    with unwritten_memory_is_nan():
        firsts = torch.autograd.grad(out, inputs, grad, create_graph=True)
    for k, (got, want) in enumerate(zip(firsts, numpy_backward(op, inputs, idx, num_segments, grad))):
        assert_close(f"{op} d/input{k}", got, want, atol=1e-12, rtol=1e-10)

    gen = torch.Generator().manual_seed(seed + 2)
    cotangents = [torch.randn(f.shape, dtype=torch.float64, generator=gen).to(device) for f in firsts]
    with unwritten_memory_is_nan():
        seconds = torch.autograd.grad(firsts, inputs + [grad], cotangents, allow_unused=True)
    expected_seconds = numpy_double_backward(op, inputs, idx, num_segments, grad, cotangents)
    for k, (got, want) in enumerate(zip(seconds, expected_seconds)):
        got = torch.zeros(want.shape, dtype=torch.float64) if got is None else got
        assert_close(f"{op} second derivative #{k}", got, want, atol=1e-11, rtol=1e-9)


@pytest.mark.parametrize("op, width", op_widths([None, 3, 2], ["scalar", "D3", "D2"]))
def test_gradcheck_and_gradgradcheck_float64(op, width, device):
    lengths = [2, 0, 5, 1]
    idx = make_idx(lengths, device)
    num_segments = 5
    inputs = tuple(t.requires_grad_() for t in make_inputs(op, idx.shape[0], num_segments, width,
                                                           torch.float64, device, seed=7))

    def fn(*args):
        return IN_SMALL_CHUNKS[op](*args, idx, num_segments)

    # Under the interpreter every kernel call is slow: check random projections of the
    # Jacobians (fast mode); compiled on the GPU, check every entry.
    fast = runtime.INTERPRETED
    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-7, fast_mode=fast)
    assert torch.autograd.gradgradcheck(fn, inputs, eps=1e-6, atol=1e-7, fast_mode=fast)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("op", ["sum", "mean", "dot", "mul", "rms_norm", "matvec"])
def test_lower_precision_computes_in_float32(op, dtype, device):
    lengths = [6, 0, 9, 1, 14]
    idx = make_idx(lengths, device)
    num_segments = 6
    inputs = [t.requires_grad_() for t in make_inputs(op, idx.shape[0], num_segments, 3, dtype, device, seed=3)]
    out = PUBLIC[op](*inputs, idx, num_segments)
    assert out.dtype == dtype
    wide = [t.detach().double().requires_grad_() for t in inputs]
    expected = PUBLIC[op](*wide, idx, num_segments)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    # The only roundings: the inputs (already in dtype, so exact in float64) and the output.
    assert_close(f"{op} {dtype}", out, expected, atol=tol, rtol=tol)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(4)).to(device=device, dtype=dtype)
    grads = torch.autograd.grad(out, inputs, grad)
    expected_grads = torch.autograd.grad(expected, wide, grad.double())
    for k, (got, want) in enumerate(zip(grads, expected_grads)):
        assert got.dtype == dtype
        assert_close(f"{op} {dtype} d/input{k}", got, want, atol=4 * tol, rtol=4 * tol)


@pytest.mark.parametrize("scale", [1e18, 1e20, 1e30], ids=["1e18", "1e20", "1e30"])
def test_rms_norm_of_huge_rows_float64_finite_float32_as_documented(scale, device):
    """``segmented_rms_norm`` sums the squares as they are: float64 gives the finite RMS
    of a float64 reference at any of these scales; float32 gives it while the squared
    norms stay below float32's largest value (3.4e38) and ``inf`` beyond, as its
    docstring says."""
    idx = make_idx([2, 3], device)
    x = torch.tensor([[3.0, 4.0], [0.0, 5.0], [1.0, 2.0], [2.0, 1.0], [-2.0, 0.0]], dtype=torch.float64) * scale
    sums = np.array([(3 ** 2 + 4 ** 2 + 5 ** 2) / 2, (5 + 5 + 4) / 3])
    reference = np.sqrt(sums) * scale
    assert_close("rms_norm float64 of huge rows", pk.segmented_rms_norm(x.to(device), idx, 2), reference,
                 atol=0.0, rtol=1e-14)
    got = pk.segmented_rms_norm(x.to(device=device, dtype=torch.float32), idx, 2)
    if (scale * 5.0) ** 2 < torch.finfo(torch.float32).max:
        assert_close("rms_norm float32 of large rows", got, reference, atol=0.0, rtol=1e-6)
    else:
        assert got.tolist() == [float("inf")] * 2


def test_empty_segments_give_zero_with_zero_gradient(device):
    """Empty segments give exactly 0, and so does the gradient of their rows: none; a segment
    of all-zero rows has rms 0 and a zero gradient of both orders (not NaN). Every
    derivative against the float64 NumPy loops."""
    idx = make_idx([0, 3, 0, 2, 0], device)
    x = torch.tensor([[1.0, 2.0], [0.5, -1.0], [3.0, 0.0], [0.0, 0.0], [0.0, 0.0]], dtype=torch.float64,
                     device=device, requires_grad=True)
    grad = torch.tensor([[0.3, -1.1], [0.0, 0.0], [2.0, 0.7], [-0.4, 1.3], [0.9, 0.2], [0.0, 0.0]],
                        dtype=torch.float64, device=device)
    for op in ("sum", "mean", "rms_norm"):
        out = PUBLIC[op](x, idx, 6)
        assert out[[0, 2, 4, 5]].abs().sum().item() == 0.0
        assert_close(f"{op} forward", out, numpy_forward(op, [x], idx, 6), atol=1e-12, rtol=1e-12)
        g = (grad[:, 0] if op == "rms_norm" else grad).clone().requires_grad_()  # so that `first` has a graph
        (first,) = torch.autograd.grad(out, x, g, create_graph=True)
        assert_close(f"{op} gradient", first, numpy_backward(op, [x], idx, 6, g)[0], atol=1e-12, rtol=1e-12)
        cotangent = torch.ones_like(first)
        (second,) = torch.autograd.grad(first, x, cotangent, allow_unused=True)
        second = torch.zeros_like(x) if second is None else second
        expected_second = numpy_double_backward(op, [x], idx, 6, g, [cotangent])[0]
        assert_close(f"{op} second derivative", second, expected_second, atol=1e-12, rtol=1e-10)
        if op == "rms_norm":
            assert out[3].item() == 0.0 and first[3:].abs().sum().item() == 0.0
            assert second[3:].abs().sum().item() == 0.0


@pytest.mark.parametrize("rows_in_order", [4, 0], ids=["in-order", "scan"])
def test_empty_segments_are_zero_in_uninitialised_memory(rows_in_order, device):
    """The output is allocated uninitialised and the first pass zeroes the empty segments:
    allocate it poisoned (NaN, and -7 for the counts), so a row nobody writes shows up.
    Both first passes: the in-order one, and the scan (all rows up to 0 columns in order)."""
    config = dataclasses.replace(SMALL_CHUNKS, rows_in_order_max_cols=rows_in_order, poison_outputs=True)
    lengths = [0, 0, 3, 0, 0, 0, 5, 1, 0, 6, 0]
    idx = make_idx(lengths, device)
    num_segments = len(lengths) + 9
    x = torch.randn(idx.shape[0], 3, dtype=torch.float64, device=device)

    for op in ("sum", "mean", "rms_norm"):
        out = api.UNCHECKED[op](x, idx, num_segments, config=config)
        assert_close(f"{op} with poisoned memory", out, PADDED[op](x, idx, num_segments), atol=1e-12, rtol=1e-12)


def assert_guards_untouched(name, t):
    """``t`` (an output of a ``poison_outputs`` launch, or a view of one) lies between
    poisoned guard rows: every element of its storage outside ``t`` must still be NaN."""
    storage = t.detach().new_empty(0).set_(t.untyped_storage())
    outside = torch.ones(storage.numel(), dtype=torch.bool)
    outside[t.storage_offset():t.storage_offset() + t.numel()] = False
    assert t.is_contiguous() and outside.sum().item() >= 2 * tk.GUARD_ROWS, f"{name}: no guard rows around it"
    assert storage[outside].isnan().all().item(), f"{name}: a write past either end of the output"


#: Leading, interior and length-1 segments; the extra empty segments go after the last.
END_LENGTHS = [0, 0, 3, 0, 5, 1, 0, 0, 6]
#: The first passes at chunks of 4 rows (scan) or 4 lanes of 2 rows (in order), with
#: programs past the last chunk as soon as there are more than 3 empty segments at the
#: ends, every output poisoned between guard rows.
ENDS_SMALL = dataclasses.replace(SMALL_CHUNKS, empty_segments_per_program=3, poison_outputs=True)
#: The default chunks (a single one here), and programs past it at 512 empty segments.
ENDS_DEFAULT = dataclasses.replace(tk.segment_config(), empty_segments_per_program=512, poison_outputs=True)


@pytest.mark.parametrize("trailing", [0, 1, 7, 5000], ids=lambda n: f"trailing{n}")
@pytest.mark.parametrize("first_pass", ["in-order", "scan"])
def test_empty_segments_at_the_ends_are_zero(trailing, first_pass, device):
    """``num_segments = idx[-1] + 1 + trailing``, with two leading and interior empty
    segments: every reduction (``sum``, ``mean``, ``dot``, ``rms_norm``, and the
    gradients of ``mul``'s ``y`` and ``matvec``'s ``m``) against the float64 NumPy loops,
    forward and first gradient, on poisoned outputs between guard rows (a segment no
    program zeroes reads NaN, a write past either end shows in the guards). Small chunks
    with many zero-only programs, and the default chunks with thousands of trailing
    segments over several programs."""
    rows_in_order = 4 if first_pass == "in-order" else 0
    idx = make_idx(END_LENGTHS, device)
    num_segments = len(END_LENGTHS) + trailing
    configs = [ENDS_SMALL] if trailing < 5000 else [ENDS_DEFAULT]
    for config in configs:
        config = dataclasses.replace(config, rows_in_order_max_cols=rows_in_order)
        for op, width in [("sum", None), ("sum", 3), ("mean", None), ("mean", 3), ("dot", 3),
                          ("rms_norm", 3), ("mul", 3), ("mul_broadcast", 3), ("matvec", 3)]:
            inputs = [t.requires_grad_() for t in make_inputs(op, idx.shape[0], num_segments, width,
                                                              torch.float64, device, seed=len(op) + trailing)]
            fn = launched_with(config)[op]
            out = fn(*inputs, idx, num_segments)
            label = f"{op} {width} trailing {trailing}"
            assert_close(f"{label} forward", out, numpy_forward(op, inputs, idx, num_segments),
                         atol=1e-12, rtol=1e-12)
            if op not in ("mul", "mul_broadcast", "matvec"):
                assert_guards_untouched(f"{label} forward", out)
            grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
            grads = torch.autograd.grad(out, inputs, grad.to(device))
            for k, (got, want) in enumerate(zip(grads, numpy_backward(op, inputs, idx, num_segments, grad))):
                assert_close(f"{label} d/input{k}", got, want, atol=1e-12, rtol=1e-12)
            if op in ("mul", "mul_broadcast", "matvec"):
                # the gradient of y or m is the segmented reduction
                assert_guards_untouched(f"{label} d/input1", grads[1])


@pytest.mark.parametrize("first_pass", ["in-order", "scan"])
def test_bfloat16_rows_are_summed_in_float32(first_pass, device):
    """bfloat16 rows against the float64 NumPy loops on the same (exactly representable)
    values, with a segment of 3000 rows near 1: a bfloat16 running sum stalls at 256
    there (256 + 1 rounds back to 256), a float32 one is off by the output's rounding
    alone: within one unit of bfloat16 (relative 2**-7; the interpreter's conversion to
    bfloat16 rounds toward zero). Forward of every reduction, and the reductions in the
    gradients of ``mul`` and ``matvec``, in both first passes."""
    config = dataclasses.replace(tk.segment_config(), rows_in_order_max_cols=4 if first_pass == "in-order" else 0)
    lengths = [5, 0, 3000, 1, 7]
    idx = make_idx(lengths, device)
    num_segments = len(lengths) + 2
    tol = 2.0 ** -7
    for op, width in [("sum", None), ("sum", 3), ("mean", 3), ("dot", 3), ("rms_norm", 3), ("mul", 3),
                      ("matvec", 3)]:
        inputs = [(1.0 + 0.05 * t.abs()).to(torch.bfloat16).requires_grad_()
                  for t in make_inputs(op, idx.shape[0], num_segments, width, torch.float64, device, seed=9)]
        out = launched_with(config)[op](*inputs, idx, num_segments)
        assert out.dtype == torch.bfloat16
        want = numpy_forward(op, inputs, idx, num_segments)
        assert_close(f"{op} bfloat16 forward", out, want, atol=tol, rtol=tol)
        grad = torch.ones(out.shape, dtype=torch.bfloat16, device=device)
        grads = torch.autograd.grad(out, inputs, grad)
        for k, (got, expected) in enumerate(zip(grads, numpy_backward(op, inputs, idx, num_segments, grad))):
            assert got.dtype == torch.bfloat16
            assert_close(f"{op} bfloat16 d/input{k}", got, expected, atol=2 * tol, rtol=2 * tol)


def test_empty_segments_at_the_ends_take_programs_past_the_last_chunk(device, monkeypatch):
    """The first pass's grid: its chunks alone while the empty segments at the ends give
    each at most ``empty_segments_per_program``, else enough programs for that many
    each (exact counts, both first passes)."""
    grids = []

    class Recording:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            grids.append(grid)
            return self.kernel[grid]

    for name in ("segment_sum_rows_kernel", "segment_reduce_chunks_kernel"):
        monkeypatch.setattr(tk, name, Recording(getattr(tk, name)))
    idx = make_idx([3, 0, 5], device)  # 8 rows: 4 chunks of 2 lanes or 2 rows
    x = torch.randn(8, dtype=torch.float64, device=device)
    config = dataclasses.replace(SMALL_CHUNKS, rows_per_thread=1, rows_in_order_threads=2, chunk_elements=2,
                                 min_chunk_rows=2, empty_segments_per_program=10)
    for rows_in_order, num_segments, programs in [(4, 3, 4), (4, 40, 4), (4, 41, 5), (4, 1000, 100),
                                                  (0, 3, 4), (0, 1000, 100)]:
        grids.clear()
        config = dataclasses.replace(config, rows_in_order_max_cols=rows_in_order)
        out = api.UNCHECKED["sum"](x, idx, num_segments, config=config)
        assert grids[0][0] == programs, (rows_in_order, num_segments, grids)
        assert_close(f"sum of {num_segments} segments", out, numpy_forward("sum", [x], idx, num_segments),
                     atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("width", [None, 1, 2, 3, 4], ids=["scalar", "D1", "D2", "D3", "D4"])
@pytest.mark.parametrize("rows_per_lane, lanes, combine_parts", [(2, 4, 2), (4, 2, 4), (1, 8, 256), (8, 2, 2)],
                         ids=["2x4-parts2", "4x2-parts4", "1x8-parts256", "8x2-parts2"])
def test_in_order_pass_matches_float64_on_random_layouts(width, rows_per_lane, lanes, combine_parts, device):
    """sum and mean of rows of up to 4 columns (the in-order first pass) on random layouts
    with empty segments and segments longer than several chunks, against float64 NumPy:
    lanes of 1 to 8 rows, and combine blocks small enough that segments cross them."""
    config = dataclasses.replace(tk.segment_config(), rows_per_thread=rows_per_lane,
                                 vector_rows_per_thread=rows_per_lane, rows_in_order_threads=lanes,
                                 combine_parts=combine_parts)
    g = torch.Generator().manual_seed(zlib.crc32(f"{width}-{rows_per_lane}-{lanes}".encode()))
    for trial in range(3):
        lengths = [int(n) for n in torch.randint(0, 4, (12,), generator=g)] + [int(torch.randint(20, 60, (1,), generator=g))]
        order = torch.randperm(len(lengths), generator=g).tolist()
        lengths = [lengths[k] for k in order]
        idx = make_idx(lengths, device)
        num_segments = len(lengths) + trial
        shape = (idx.shape[0],) if width is None else (idx.shape[0], width)
        x = torch.randn(shape, generator=g, dtype=torch.float64).to(device)
        x_np, idx_np = x.cpu().numpy(), idx.cpu().numpy()
        for op, reference in (("sum", naive_numpy.segmented_sum_numpy), ("mean", naive_numpy.segmented_mean_numpy)):
            want = torch.from_numpy(reference(x_np, idx_np, num_segments))
            got = api.UNCHECKED[op](x, idx, num_segments, config=config)
            assert_close(f"{op} {lengths}", got, want, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("op", OPS)
def test_strided_inputs_and_idx(op, device):
    """Every input, idx included, as a view with a stride of 2 (and x also transposed
    into a non-contiguous (N, 3) layout): the same result as on contiguous copies, through
    the public function and in small chunks."""
    lengths = [3, 0, 5, 1, 7, 2]
    idx = make_idx(lengths, device)
    num_segments = len(lengths) + 1
    g = torch.Generator().manual_seed(zlib.crc32(op.encode()))
    width = None if op not in ("matvec", "mul_broadcast") else 3
    inputs = make_inputs(op, idx.shape[0], num_segments, width, torch.float64, device, 7)
    spread_idx = torch.stack([idx, torch.full_like(idx, 10 ** 6)], 1).reshape(-1)[::2]
    assert not spread_idx.is_contiguous() and torch.equal(spread_idx, idx)
    strided = []
    for t in inputs:
        wide = torch.randn((t.shape[0], 2) + t.shape[1:], generator=g, dtype=t.dtype).to(device)
        wide[:, 0] = t
        strided.append(wide[:, 0])
    assert not strided[0].is_contiguous()
    want = PADDED[op](*inputs, idx, num_segments)
    x3 = torch.randn(3, idx.shape[0], generator=g, dtype=torch.float64).to(device).t()
    for label, fn in (("public", PUBLIC[op]), ("small chunks", IN_SMALL_CHUNKS[op])):
        assert_close(f"{op} strided, {label}", fn(*strided, spread_idx, num_segments), want, atol=1e-12, rtol=1e-12)
        if op in ("sum", "mean", "rms_norm"):
            assert_close(f"{op} transposed, {label}", fn(x3, spread_idx, num_segments),
                         PADDED[op](x3.contiguous(), idx, num_segments), atol=1e-12, rtol=1e-12)


def test_no_rows(device):
    """No rows: every segment is empty (exactly 0, in the input's dtype), and with no segments
    either the output has no rows; the row-wise operations give no rows."""
    idx = torch.zeros(0, dtype=torch.int32, device=device)
    x = torch.zeros(0, 3, dtype=torch.float32, device=device, requires_grad=True)
    for op in ("sum", "mean", "rms_norm"):
        with unwritten_memory_is_nan():  # an output that no kernel writes reads as NaN
            out = PUBLIC[op](x, idx, 4)
        want = torch.zeros((4,) if op == "rms_norm" else (4, 3), dtype=torch.float32, device=device)
        assert out.dtype == torch.float32 and torch.equal(out, want), op
        (grad,) = torch.autograd.grad(out.sum(), x)
        assert torch.equal(grad, torch.zeros(0, 3, device=device)), op
    assert torch.equal(pk.segmented_dot(x, x, idx, 4), torch.zeros(4, device=device))
    assert torch.equal(pk.segmented_sum(x, idx, 0), torch.zeros(0, 3, device=device))
    assert torch.equal(pk.segmented_mul(x, torch.ones(4, 3, device=device), idx, 4), torch.zeros(0, 3, device=device))
    assert torch.equal(pk.segmented_matvec(x, torch.zeros(4, 3, 2, device=device), idx, 4),
                       torch.zeros(0, 2, device=device))


@pytest.mark.parametrize("width", [None, 3], ids=["scalar", "D3"])
def test_output_shapes_and_values(width, device):
    """Each operation's output shape for ``(N,)`` and ``(N, D)`` inputs (``(S,)``, ``(S, D)``
    or ``x``'s), with its values: the float64 NumPy loops' on the same float32 inputs."""
    idx = make_idx([2, 3], device)
    for op in OPS:
        if not applicable(op, width):
            continue
        inputs = make_inputs(op, 5, 4, width, torch.float32, device, seed=13)
        out = PUBLIC[op](*inputs, idx, 4)
        rows = inputs[0].shape
        shape = {"dot": (4,), "rms_norm": (4,), "sum": (4,) + rows[1:], "mean": (4,) + rows[1:],
                 "matvec": (5, 4)}.get(op, rows)
        assert out.shape == shape and out.dtype == torch.float32, op
        assert_close(f"{op} values", out, numpy_forward(op, inputs, idx, 4), atol=1e-5, rtol=1e-5)


def test_wide_rows_use_several_column_blocks(device):
    # 70 columns: two column blocks of the reduction and of the row-wise maps.
    idx = make_idx([3, 0, 6, 1], device)
    x = torch.randn(10, 70, dtype=torch.float64, device=device, requires_grad=True)
    for op in ("sum", "mean", "rms_norm"):
        out = IN_SMALL_CHUNKS[op](x, idx, 5)
        assert_close(f"{op} D70", out, PADDED[op](x, idx, 5), atol=1e-12, rtol=1e-12)
        grad = torch.randn_like(out)
        (got,) = torch.autograd.grad(out, x, grad)
        (want,) = torch.autograd.grad(PADDED[op](x, idx, 5), x, grad)
        assert_close(f"{op} D70 gradient", got, want, atol=1e-12, rtol=1e-10)


def test_bitwise_deterministic(device):
    g = torch.Generator().manual_seed(11)
    lengths = torch.randint(0, 12, (8,), generator=g).tolist() + [40]
    idx = make_idx(lengths, device)
    num_segments = len(lengths)
    x = torch.randn(idx.shape[0], 3, generator=g).to(device).requires_grad_()
    m = torch.randn(num_segments, 3, 3, generator=g).to(device).requires_grad_()

    def run():
        outs = [pk.segmented_sum(x, idx, num_segments), pk.segmented_mean(x, idx, num_segments),
                pk.segmented_rms_norm(x, idx, num_segments), pk.segmented_matvec(x, m, idx, num_segments)]
        loss = sum((o * o).sum() for o in outs)
        grads = torch.autograd.grad(loss, (x, m), create_graph=True)
        seconds = torch.autograd.grad(sum(gr.square().sum() for gr in grads), (x, m))
        return [o.detach() for o in outs] + [gr.detach() for gr in grads] + list(seconds)

    first, second = run(), run()
    for k, (a, b) in enumerate(zip(first, second)):
        assert torch.equal(a, b), f"result {k} differs between two identical runs"


# --- GPU only: the compiled kernels at sizes the interpreter cannot reach -----------------

@pytest.mark.gpu_only
@pytest.mark.parametrize("mean_length", [1, 10, 10_000, 1_000_000], ids=lambda n: f"len{n}")
@pytest.mark.parametrize("width", [None, 3], ids=["scalar", "D3"])
def test_large_against_index_add(mean_length, width, device):
    g = torch.Generator(device="cuda").manual_seed(mean_length)
    n_rows = 2_000_003
    num_segments = max(1, n_rows // mean_length)
    idx = torch.sort(torch.randint(0, num_segments, (n_rows,), device="cuda", generator=g)).values.int()
    shape = (n_rows,) if width is None else (n_rows, width)
    x = torch.randn(shape, device="cuda", generator=g)
    reference = torch.zeros((num_segments,) + shape[1:], dtype=torch.float64, device="cuda")
    reference.index_add_(0, idx.long(), x.double())
    counts = torch.bincount(idx.long(), minlength=num_segments).clamp(min=1).double()
    counts = counts if width is None else counts[:, None]
    scale = 1e-5 * max(1.0, mean_length ** 0.5)
    assert_close("sum", pk.segmented_sum(x, idx, num_segments), reference, atol=scale, rtol=1e-5)
    assert_close("mean", pk.segmented_mean(x, idx, num_segments), reference / counts, atol=1e-5, rtol=1e-5)
    a = pk.segmented_sum(x, idx, num_segments)
    b = pk.segmented_sum(x, idx, num_segments)
    assert torch.equal(a, b)


@pytest.mark.gpu_only
@pytest.mark.parametrize("width", [None, 3], ids=["scalar", "D3"])
def test_lane_loads_aligned_unaligned_and_half(width, device):
    """The in-order pass reads a lane's rows with 16-byte loads only from 16-byte aligned
    32-bit data: views that start one row in, and float16 rows, take the tile loads. Every
    case against float64, on a length that ends inside a group of 4 rows."""
    g = torch.Generator(device="cuda").manual_seed(3)
    n_rows = 300_001
    num_segments = n_rows // 7
    idx_store = torch.sort(torch.randint(0, num_segments, (n_rows + 1,), device="cuda", generator=g)).values.int()
    x_store = torch.randn((n_rows + 1,) + (() if width is None else (width,)), device="cuda", generator=g)
    for label, x, idx in (("aligned", x_store[:-1], idx_store[:-1]), ("x one row in", x_store[1:], idx_store[:-1]),
                          ("idx one row in", x_store[:-1], idx_store[1:]), ("float16", x_store[:-1].half(), idx_store[:-1])):
        reference = torch.zeros((num_segments,) + x.shape[1:], dtype=torch.float64, device="cuda")
        reference.index_add_(0, idx.long(), x.double())
        counts = torch.bincount(idx.long(), minlength=num_segments).clamp(min=1).double()
        counts = counts if width is None else counts[:, None]
        tol = 1e-2 if x.dtype == torch.float16 else 1e-5
        assert_close(f"sum, {label}", pk.segmented_sum(x, idx, num_segments), reference, atol=tol, rtol=tol)
        assert_close(f"mean, {label}", pk.segmented_mean(x, idx, num_segments), reference / counts, atol=tol, rtol=tol)


@pytest.mark.gpu_only
@pytest.mark.parametrize("mean_length", [10, 10_000], ids=lambda n: f"len{n}")
def test_large_all_ops_both_orders_deterministic_and_close(mean_length, device):
    """At a million rows (many chunks, long segments crossing hundreds of them): every op,
    forward, first and second derivatives, bitwise equal over two runs and close to the
    float64 result of the padded stage."""
    g = torch.Generator(device="cuda").manual_seed(5)
    n_rows = 1_000_003
    num_segments = max(1, n_rows // mean_length)
    idx = torch.sort(torch.randint(0, num_segments, (n_rows,), device="cuda", generator=g)).values.int()
    for op in ("sum", "mean", "dot", "mul", "rms_norm", "matvec"):
        inputs = [t.requires_grad_() for t in make_inputs(op, n_rows, num_segments, 3, torch.float32, "cuda", 1)]

        def run(args):
            out = PUBLIC[op](*args, idx, num_segments)
            grad = torch.ones_like(out).requires_grad_()
            firsts = torch.autograd.grad(out, args, grad, create_graph=True)
            seconds = torch.autograd.grad(firsts, list(args) + [grad], [torch.ones_like(f) for f in firsts],
                                          allow_unused=True)
            return [out] + list(firsts) + [s for s in seconds if s is not None]

        first, again = run(inputs), run(inputs)
        for k, (a, b) in enumerate(zip(first, again)):
            assert torch.equal(a, b), f"{op}: result {k} differs between two identical runs"
        wide = [t.detach().double().requires_grad_() for t in inputs]
        out64 = PADDED[op](*wide, idx, num_segments)
        scale = float(out64.detach().abs().max()) + 1.0
        assert_close(f"{op} forward at 1M rows", first[0], out64, atol=1e-5 * scale, rtol=1e-4)
        firsts64 = torch.autograd.grad(out64, wide, torch.ones_like(out64))
        for k, (a, b) in enumerate(zip(first[1:1 + len(wide)], firsts64)):
            assert_close(f"{op} d/input{k} at 1M rows", a, b, atol=1e-5 * (float(b.abs().max()) + 1.0), rtol=1e-4)


@pytest.mark.parametrize("op", ["sum", "mean"])
def test_one_dimensional_rows_take_one_autograd_node_each_way(op, device):
    """``sum`` and ``mean`` of ``(N,)`` rows (and their backwards) are one node of the
    autograd graph, no reshaped views around it (each view is one more node for the
    engine); the output is an ordinary tensor, so it can be changed in place."""
    idx = make_idx([2, 0, 3], device)
    x = torch.arange(1.0, 6.0, dtype=torch.float64, device=device).requires_grad_()
    out = PUBLIC[op](x, idx, 3)
    assert type(out.grad_fn).__name__ == f"Eager_segment_{op}Backward"
    assert out.grad_fn.next_functions[0][0].variable is x
    out.mul_(2)
    (grad,) = torch.autograd.grad(out, x, torch.ones_like(out).requires_grad_(), create_graph=True)
    assert type(grad.grad_fn).__name__ == ("Eager_segment_gatherBackward" if op == "sum"
                                           else "Eager_segment_gather_over_countBackward")
    want = torch.tensor([2.0, 2.0, 2.0, 2.0, 2.0] if op == "sum" else [1.0, 1.0, 2 / 3, 2 / 3, 2 / 3],
                        dtype=torch.float64, device=device)
    assert_close(f"{op} d/dx", grad, want, atol=1e-15, rtol=1e-15)


@pytest.mark.gpu_only
def test_cuda_graph_capture_skips_host_checks():
    idx = make_idx([3, 0, 500, 1], "cuda")
    idx64 = idx.long()
    x = torch.randn(idx.shape[0], 3, device="cuda")
    pk.segmented_sum(x, idx, 4)  # compile outside the capture
    pk.segmented_mean(x, idx, 4)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = pk.segmented_sum(x, idx, 4)
        mean = pk.segmented_mean(x, idx, 4)
        out64 = pk.segmented_sum(x, idx64, 4)  # the int64 idx converted inside the graph
    x.normal_()
    graph.replay()
    torch.cuda.synchronize()
    assert_close("captured sum", out, padded_torch.segmented_sum_padded(x, idx, 4), atol=1e-5, rtol=1e-5)
    assert_close("captured mean", mean, padded_torch.segmented_mean_padded(x, idx, 4), atol=1e-5, rtol=1e-5)
    assert torch.equal(out64, out)
