"""Segment operations: the arguments they accept (int32 and int64 ``idx``, inputs of two
dtypes) and, in one table, the ones they refuse, each with its exception and the
argument its message names."""
import pytest
import torch

import packed_kernels as pk
from packed_kernels.ops.segment import triton_kernels as tk

from assertions import assert_close
from segment_cases import LAUNCHERS, OPS, PADDED, PUBLIC, make_idx, make_inputs


# --- int32 and int64 idx -------------------------------------------------------------------

@pytest.mark.parametrize("op", OPS)
def test_int64_idx_gives_the_int32_results_and_the_kernels_read_int32(op, device, monkeypatch):
    """An int64 ``idx`` (what ``repeat_interleave`` gives) gives bitwise the results of the
    int32 one, forward and both derivative orders, and is converted once at the public
    function: every index the launchers receive is int32."""
    lengths = [3, 0, 5, 1, 2]
    idx = make_idx(lengths, device)
    num_segments = len(lengths) + 1
    width = None if op not in ("matvec", "mul_broadcast") else 3
    inputs = [t.requires_grad_() for t in make_inputs(op, idx.shape[0], num_segments, width,
                                                      torch.float64, device, seed=2)]

    def run(segment_ids):
        out = PUBLIC[op](*inputs, segment_ids, num_segments)
        firsts = torch.autograd.grad(out.square().sum(), inputs, create_graph=True)
        seconds = torch.autograd.grad(sum(f.square().sum() for f in firsts), inputs)
        return [out.detach(), *(f.detach() for f in firsts), *seconds]

    index_dtypes = set()

    def recording(launcher):
        def launch(*args, **kwargs):
            index_dtypes.update(a.dtype for a in (*args, *kwargs.values())
                                if isinstance(a, torch.Tensor) and not a.is_floating_point())
            return launcher(*args, **kwargs)
        return launch

    for name in LAUNCHERS:
        monkeypatch.setattr(tk, name, recording(getattr(tk, name)))
    want = run(idx)
    index_dtypes.clear()
    got = run(idx.long())
    assert index_dtypes == {torch.int32}
    for k, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"{op}: result {k} differs between int64 and int32 idx"


def test_segment_ids_from_lengths_build_idx(device):
    """The helper from lengths gives the idx the operations take, in either dtype."""
    lengths = torch.tensor([2, 0, 3], device=device)
    x = torch.arange(5.0, dtype=torch.float64, device=device)
    for dtype in (torch.int32, torch.int64):
        idx = pk.segment_ids_from_lengths(lengths, dtype=dtype)
        assert idx.tolist() == [0, 0, 2, 2, 2]
        assert pk.segmented_sum(x, idx, 3).tolist() == [1.0, 0.0, 9.0]


# --- inputs of two dtypes ----------------------------------------------------------------------

PAIRS = [
    pytest.param(torch.bfloat16, torch.float32, id="bf16-f32"),
    pytest.param(torch.float32, torch.float16, id="f32-f16"),
    pytest.param(torch.float16, torch.bfloat16, id="f16-bf16"),
    pytest.param(torch.float32, torch.float64, id="f32-f64"),
]


@pytest.mark.parametrize("first, second", PAIRS)
@pytest.mark.parametrize("op", ["dot", "mul", "mul_broadcast", "matvec"])
def test_two_dtypes_are_promoted(op, first, second, device):
    """``x`` and ``y`` (``v`` and ``m``) of two dtypes: the result is that of both cast to
    ``torch.promote_types`` of them (bitwise), and each gradient is the promoted
    gradient in its input's own dtype."""
    lengths = [3, 0, 4, 2]
    idx = make_idx(lengths, device)
    num_segments = len(lengths)
    promoted = torch.promote_types(first, second)
    inputs = make_inputs(op, idx.shape[0], num_segments, 3, torch.float64, device, seed=5)
    mixed = [t.to(dtype).requires_grad_() for t, dtype in zip(inputs, (first, second))]
    wide = [t.detach().to(promoted).requires_grad_() for t in mixed]
    out = PUBLIC[op](*mixed, idx, num_segments)
    want = PUBLIC[op](*wide, idx, num_segments)
    assert out.dtype == promoted
    assert torch.equal(out, want)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(device=device, dtype=promoted)
    for k, (got, expected, t) in enumerate(zip(torch.autograd.grad(out, mixed, grad),
                                               torch.autograd.grad(want, wide, grad), mixed)):
        assert got.dtype == t.dtype
        assert torch.equal(got, expected.to(t.dtype)), f"{op}: gradient {k}"


def test_promoted_result_is_close_to_float64(device):
    """bfloat16 rows times float32 factors, against the float64 padded stage of the same
    (exactly representable) values."""
    idx = make_idx([4, 1, 3], device)
    x, y = make_inputs("mul", idx.shape[0], 3, 3, torch.float64, device, seed=9)
    x, y = x.to(torch.bfloat16), y.float()
    assert_close("mul of bf16 and f32", pk.segmented_mul(x, y, idx, 3),
                 PADDED["mul"](x.double(), y.double(), idx, 3), atol=1e-6, rtol=1e-6)


# --- bad input: one table ----------------------------------------------------------------

def _arguments(device):
    """Good arguments of every operation; a case spoils one of them."""
    idx = make_idx([2, 3], device)
    return dict(x=torch.randn(5, 3, device=device), idx=idx, idx64=idx.long(), y_seg=torch.randn(2, 3, device=device),
                m=torch.randn(2, 3, 3, device=device), meta_idx=idx.to("meta"))


def _huge(dtype=torch.float32, rows=2 ** 31):
    """A meta tensor of ``rows`` rows: shapes only, no memory."""
    return torch.empty(rows, dtype=dtype, device="meta")


def _vmap(fn, *batched):
    return torch.func.vmap(fn)(*(t[None].expand(2, *t.shape) for t in batched))


BAD = [
    # idx: type, dtype, rank, length
    ("sum-idx-list", lambda a: pk.segmented_sum(a["x"], [0, 0, 1, 1, 1], 2), TypeError,
     "idx must be a torch.Tensor"),
    ("mean-idx-list", lambda a: pk.segmented_mean(a["x"], [0, 0, 1, 1, 1], 2), TypeError,
     "idx must be a torch.Tensor"),
    ("sum-idx-float", lambda a: pk.segmented_sum(a["x"], a["idx"].float(), 2), TypeError,
     "idx must be int32 or int64; got torch.float32"),
    ("dot-idx-int16", lambda a: pk.segmented_dot(a["x"], a["x"], a["idx"].short(), 2), TypeError,
     "idx must be int32 or int64; got torch.int16"),
    ("sum-idx-2D", lambda a: pk.segmented_sum(a["x"], a["idx"][:, None], 2), ValueError, "idx must be 1-D"),
    ("sum-idx-short", lambda a: pk.segmented_sum(a["x"], a["idx"][:4], 2), ValueError,
     r"idx must have one entry per row of x \(5\)"),
    ("matvec-idx-short", lambda a: pk.segmented_matvec(a["x"], a["m"], a["idx"][:4], 2), ValueError,
     r"idx must have one entry per row of v \(5\)"),
    # idx values, int32 and int64
    ("sum-idx-negative", lambda a: pk.segmented_sum(a["x"], a["idx"] - 1, 2), ValueError, "idx must be >= 0"),
    ("sum-idx64-negative", lambda a: pk.segmented_sum(a["x"], a["idx64"] - 1, 2), ValueError, "idx must be >= 0"),
    ("sum-idx-too-large", lambda a: pk.segmented_sum(a["x"], a["idx"], 1), ValueError,
     r"idx must be < num_segments \(1\)"),
    ("rms-idx-too-large", lambda a: pk.segmented_rms_norm(a["x"], a["idx"], 1), ValueError,
     r"idx must be < num_segments \(1\)"),
    ("mul-idx-too-large", lambda a: pk.segmented_mul(a["x"], a["y_seg"][:1], a["idx"], 1), ValueError,
     r"idx must be < num_segments \(1\)"),
    # 2**32 + 1 would become 1 in int32, sorted and in range: checked before the conversion
    ("sum-idx64-beyond-int32",
     lambda a: pk.segmented_sum(a["x"], torch.tensor([0, 0, 1, 1, 2 ** 32 + 1], device=a["x"].device), 2),
     ValueError, "idx must be < num_segments"),
    ("sum-idx-unsorted", lambda a: pk.segmented_sum(a["x"], a["idx"].flip(0), 2), ValueError,
     "idx must be sorted in non-decreasing order; 1 entries"),
    ("mean-idx64-unsorted", lambda a: pk.segmented_mean(a["x"], a["idx64"].flip(0), 2), ValueError,
     "idx must be sorted"),
    # int64 idx: rows and segments countable in int32 (meta tensors: shapes without memory)
    ("sum-idx64-2**31-rows", lambda a: pk.segmented_sum(_huge(), _huge(torch.int64), 2), ValueError,
     r"idx of int64 must have fewer than 2\*\*31 entries"),
    ("sum-idx64-2**31-segments", lambda a: pk.segmented_sum(a["x"].to("meta"), a["meta_idx"].long(), 2 ** 31),
     ValueError, r"num_segments must be < 2\*\*31 for an int64 idx"),
    ("mul-idx64-2**31-segments",
     lambda a: pk.segmented_mul(a["x"].to("meta"), _huge(rows=2 ** 31), a["meta_idx"].long(), 2 ** 31),
     ValueError, "num_segments must be < 2"),
    # x
    ("sum-x-int", lambda a: pk.segmented_sum(a["x"].long(), a["idx"], 2), TypeError,
     "x must be float16, bfloat16, float32 or float64; got torch.int64"),
    ("sum-x-3D", lambda a: pk.segmented_sum(a["x"][:, :, None], a["idx"], 2), ValueError, "x must be 1-D or 2-D"),
    ("mean-x-no-columns", lambda a: pk.segmented_mean(a["x"][:, :0], a["idx"], 2), ValueError,
     r"x must have non-empty trailing dimensions; got shape \(5, 0\)"),
    ("rms-x-list", lambda a: pk.segmented_rms_norm([1.0] * 5, a["idx"], 2), TypeError, "x must be a torch.Tensor"),
    # num_segments
    ("sum-num_segments-float", lambda a: pk.segmented_sum(a["x"], a["idx"], 3.0), TypeError,
     "num_segments must be a Python int"),
    ("sum-num_segments-negative", lambda a: pk.segmented_sum(a["x"], a["idx"], -1), ValueError,
     "num_segments must be >= 0"),
    # the second input
    ("dot-y-shape", lambda a: pk.segmented_dot(a["x"], a["x"][:, :2], a["idx"], 2), ValueError,
     "y must have the shape of x"),
    ("dot-y-int", lambda a: pk.segmented_dot(a["x"], a["x"].int(), a["idx"], 2), TypeError,
     "y must be float16, bfloat16, float32 or float64; got torch.int32"),
    ("dot-y-3D", lambda a: pk.segmented_dot(a["x"], a["x"][:, :, None], a["idx"], 2), ValueError,
     "y must be 1-D or 2-D"),
    ("mul-y-rows", lambda a: pk.segmented_mul(a["x"], a["y_seg"], a["idx"], 3), ValueError,
     r"y must have num_segments \(3\) rows"),
    ("mul-y-shape", lambda a: pk.segmented_mul(a["x"], a["y_seg"][:, :2], a["idx"], 2), ValueError,
     r"y must have shape \(2, 3\) or \(2,\)"),
    ("mul-y-int", lambda a: pk.segmented_mul(a["x"], a["y_seg"].long(), a["idx"], 2), TypeError, "y must be float16"),
    ("mul-y-no-columns", lambda a: pk.segmented_mul(a["x"], a["y_seg"][:, :0], a["idx"], 2), ValueError,
     "y must have non-empty trailing dimensions"),
    ("matvec-m-count", lambda a: pk.segmented_matvec(a["x"], a["m"], a["idx"], 3), ValueError,
     r"m must have num_segments \(3\) matrices"),
    ("matvec-m-shape", lambda a: pk.segmented_matvec(a["x"], a["m"][:, :2], a["idx"], 2), ValueError,
     r"m must have shape \(2, 3, K\)"),
    ("matvec-v-1D", lambda a: pk.segmented_matvec(a["x"][:, 0], a["m"], a["idx"], 2), ValueError, "v must be 2-D"),
    ("matvec-m-2D", lambda a: pk.segmented_matvec(a["x"], a["m"].flatten(1), a["idx"], 2), ValueError,
     "m must be 3-D"),
    ("matvec-m-int", lambda a: pk.segmented_matvec(a["x"], a["m"].int(), a["idx"], 2), TypeError, "m must be float16"),
    ("matvec-m-no-columns", lambda a: pk.segmented_matvec(a["x"], a["m"][:, :, :0], a["idx"], 2), ValueError,
     "m must have non-empty trailing dimensions"),
    # devices
    ("sum-idx-device", lambda a: pk.segmented_sum(a["x"], a["meta_idx"], 2), ValueError, "idx must be on x's device"),
    ("dot-y-device", lambda a: pk.segmented_dot(a["x"], a["x"].to("meta"), a["idx"], 2), ValueError,
     "y must be on x's device"),
    ("matvec-m-device", lambda a: pk.segmented_matvec(a["x"], a["m"].to("meta"), a["idx"], 2), ValueError,
     "m must be on v's device"),
    # torch.func.vmap: refused with a clear error, whichever argument is batched
    ("sum-vmap-x", lambda a: _vmap(lambda x: pk.segmented_sum(x, a["idx"], 2), a["x"]), NotImplementedError,
     "x is batched by torch.func.vmap"),
    ("mean-vmap-idx", lambda a: _vmap(lambda i: pk.segmented_mean(a["x"], i, 2), a["idx"]), NotImplementedError,
     "idx is batched by torch.func.vmap"),
    ("matvec-vmap-m", lambda a: _vmap(lambda m: pk.segmented_matvec(a["x"], m, a["idx"], 2), a["m"]),
     NotImplementedError, "m is batched by torch.func.vmap"),
    ("rms-vmap-grad-x", lambda a: _vmap(torch.func.grad(lambda x: pk.segmented_rms_norm(x, a["idx"], 2).sum()), a["x"]),
     NotImplementedError, "x is batched by torch.func.vmap"),
]


@pytest.mark.parametrize("call, error, message", [pytest.param(*case[1:], id=case[0]) for case in BAD])
def test_bad_input(call, error, message, device):
    with pytest.raises(error, match=message):
        call(_arguments(device))
