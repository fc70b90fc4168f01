"""Segment operations: the arguments they accept (int32 and int64 ``idx``, inputs of two
dtypes) and, in one table per operation, the ones they refuse, each with its exception
and the argument its message names."""
import re

import pytest
import torch

import packed_kernels as pk
from packed_kernels.ops.segment import triton_kernels as tk

from assertions import assert_close
from segment_cases import LAUNCHERS, OPS, PADDED, PUBLIC, make_idx, make_inputs, numpy_forward


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


# --- bad input: one table per operation ---------------------------------------------------
# Each row spoils one argument of a good call: the exception, the argument the message
# starts with, and words it must contain. Rows marked *wrong if unchecked* are values that,
# had they reached the kernels, would give a plausible result or index out of bounds.

FUNCTIONS = {"sum": pk.segmented_sum, "mean": pk.segmented_mean, "dot": pk.segmented_dot, "mul": pk.segmented_mul,
             "rms_norm": pk.segmented_rms_norm, "matvec": pk.segmented_matvec}
SIGNATURES = {"sum": ("x", "idx", "num_segments"), "mean": ("x", "idx", "num_segments"),
              "dot": ("x", "y", "idx", "num_segments"), "mul": ("x", "y", "idx", "num_segments"),
              "rms_norm": ("x", "idx", "num_segments"), "matvec": ("v", "m", "idx", "num_segments")}


def good_arguments(op, device):
    """A good call of ``op``, by keyword: 5 rows of 3 columns in 2 segments of 2 and 3 rows."""
    g = torch.Generator().manual_seed(12)
    rand = lambda *shape: torch.randn(shape, generator=g).to(device)  # noqa: E731
    arguments = dict(idx=make_idx([2, 3], device), num_segments=2)
    rows, second = SIGNATURES[op][0], SIGNATURES[op][1]
    arguments[rows] = rand(5, 3)
    if second == "y":
        arguments["y"] = rand(5, 3) if op == "dot" else rand(2, 3)
    elif second == "m":
        arguments["m"] = rand(2, 3, 4)
    return arguments


def _huge(dtype=torch.float32, *shape):
    """A meta tensor of 2**31 rows (and ``shape`` after them): shapes only, no memory."""
    return torch.empty((2 ** 31,) + shape, dtype=dtype, device="meta")


def _meta(arguments):
    return {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in arguments.items()}


def _call(op, **changes):
    """The call of ``op`` with ``changes``: values, or functions of (good arguments, device)."""
    def call(arguments, device):
        for name, value in changes.items():
            arguments[name] = value(arguments, device) if callable(value) else value
        return FUNCTIONS[op](**arguments)
    return call


def _vmapped(op, name):
    """``op`` under ``torch.func.vmap`` over a batch of two copies of argument ``name``."""
    def call(arguments, device):
        batched = arguments.pop(name)
        batch = batched[None].expand(2, *batched.shape)
        return torch.func.vmap(lambda t: FUNCTIONS[op](**arguments, **{name: t}))(batch)
    return call


def _index_rows(op):
    """The rows every operation refuses, for its ``idx``, ``num_segments`` and rows argument."""
    r = SIGNATURES[op][0]
    other = "meta"
    with_segments = {"dot": {}, "mul": {"y": lambda a, d: a["y"][:0]}, "matvec": {"m": lambda a, d: a["m"][:0]}}
    no_segments = with_segments.get(op, {})
    huge_segments = {"mul": {"y": _huge()}, "matvec": {"m": _huge(torch.float32, 3, 4)}}.get(op, {})
    huge_rows = {"dot": {"x": _huge(), "y": _huge()}, "matvec": {"v": _huge(torch.float32, 3),
                                                                 "m": torch.empty(2, 3, 4, device="meta")},
                 "mul": {"x": _huge(), "y": torch.empty(2, device="meta")}}.get(op, {r: _huge()})
    return [
        ("idx-list", _call(op, idx=[0, 0, 1, 1, 1]), TypeError, "idx", "must be a torch.Tensor; got list"),
        ("idx-float", _call(op, idx=lambda a, d: a["idx"].float()), TypeError, "idx",
         "must be int32 or int64; got torch.float32"),
        ("idx-int16", _call(op, idx=lambda a, d: a["idx"].short()), TypeError, "idx", "got torch.int16"),
        ("idx-bool", _call(op, idx=lambda a, d: a["idx"] > 0), TypeError, "idx", "got torch.bool"),
        ("idx-2D", _call(op, idx=lambda a, d: a["idx"][:, None]), ValueError, "idx", "must be 1-D; got shape (5, 1)"),
        ("idx-short", _call(op, idx=lambda a, d: a["idx"][:4]), ValueError, "idx",
         f"must have one entry per row of {r} (5); got 4 entries"),
        # values checked on the device: the message names the function first
        ("idx-negative", _call(op, idx=lambda a, d: a["idx"] - 1), ValueError, "idx",
         f"segmented_{op}: idx must lie in [0, num_segments), which fails at row 0"),
        ("idx64-negative", _call(op, idx=lambda a, d: a["idx"].long() - 1), ValueError, "idx",
         f"segmented_{op}: idx must lie in [0, num_segments), which fails at row 0"),
        ("idx-negative-last", _call(op, idx=lambda a, d: torch.tensor([0, 0, 1, 1, -1], device=d)), ValueError,
         "idx", f"segmented_{op}: idx must lie in [0, num_segments), which fails at row 4"),
        ("idx-too-large", _call(op, idx=lambda a, d: a["idx"] + 1), ValueError, "idx",
         f"segmented_{op}: idx must lie in [0, num_segments), which fails at row 2"),
        # wrong if unchecked: 2**32 + 1 is 1 in int32, sorted and in range
        ("idx64-beyond-int32", _call(op, idx=lambda a, d: torch.tensor([0, 0, 1, 1, 2 ** 32 + 1], device=d)),
         ValueError, "idx", f"segmented_{op}: idx must lie in [0, num_segments), which fails at row 4"),
        ("idx-unsorted", _call(op, idx=lambda a, d: a["idx"].flip(0)), ValueError, "idx",
         f"segmented_{op}: idx must be sorted in non-decreasing order, which fails at row 3"),
        ("idx64-unsorted", _call(op, idx=lambda a, d: a["idx"].long().flip(0)), ValueError, "idx",
         f"segmented_{op}: idx must be sorted in non-decreasing order, which fails at row 3"),
        ("idx-unsorted-in-range", _call(op, idx=lambda a, d: torch.tensor([0, 1, 0, 1, 1], device=d)), ValueError,
         "idx", f"segmented_{op}: idx must be sorted in non-decreasing order, which fails at row 2"),
        ("idx-other-device", _call(op, idx=lambda a, d: a["idx"].to(other)), ValueError, "idx",
         f"must be on {r}'s device"),
        # one set of segments per call; vmap over the other arguments works (test_segment_vmap)
        ("idx-vmapped", _vmapped(op, "idx"), NotImplementedError, "idx", "is batched by torch.func.vmap"),
        # wrong if unchecked: no idx value can be in range, and there is no segment to clamp to
        ("rows-without-segments", _call(op, num_segments=0, **no_segments), ValueError, "idx",
         "must be < num_segments (0), which no row can meet; got 5 rows"),
        ("idx64-2**31-rows", lambda a, d: FUNCTIONS[op](**dict(_meta(a), idx=_huge(torch.int64), **huge_rows)),
         ValueError, "idx", "of int64 must have fewer than 2**31 entries"),
        ("num_segments-float", _call(op, num_segments=2.0), TypeError, "num_segments",
         "must be a Python int; got float"),
        ("num_segments-bool", _call(op, num_segments=True), TypeError, "num_segments", "got bool"),
        ("num_segments-tensor", _call(op, num_segments=torch.tensor(2)), TypeError, "num_segments", "got Tensor"),
        ("num_segments-negative", _call(op, num_segments=-1), ValueError, "num_segments", "must be >= 0; got -1"),
        ("num_segments-2**31-with-idx64",
         lambda a, d: FUNCTIONS[op](**dict(_meta(a), idx=a["idx"].long().to("meta"), num_segments=2 ** 31,
                                           **huge_segments)),
         ValueError, "num_segments", "must be < 2**31 for an int64 idx"),
        (f"{r}-list", _call(op, **{r: lambda a, d: a[r].tolist()}), TypeError, r, "must be a torch.Tensor; got list"),
        (f"{r}-int", _call(op, **{r: lambda a, d: a[r].long()}), TypeError, r,
         "must be float16, bfloat16, float32 or float64; got torch.int64"),
        (f"{r}-bool", _call(op, **{r: lambda a, d: a[r] > 0}), TypeError, r, "got torch.bool"),
        (f"{r}-3D", _call(op, **{r: lambda a, d: a[r][:, :, None]}), ValueError, r,
         "must be 2-D" if op == "matvec" else "must be 1-D or 2-D; got shape (5, 3, 1)"),
        (f"{r}-0D", _call(op, **{r: lambda a, d: a[r][0, 0]}), ValueError, r, "got shape ()"),
        (f"{r}-no-columns", _call(op, **{r: lambda a, d: a[r][:, :0]}), ValueError, r,
         "must have non-empty trailing dimensions; got shape (5, 0)"),
    ]


_SECOND_ROWS = {
    "dot": [
        ("y-list", _call("dot", y=lambda a, d: a["y"].tolist()), TypeError, "y", "must be a torch.Tensor"),
        ("y-int", _call("dot", y=lambda a, d: a["y"].int()), TypeError, "y",
         "must be float16, bfloat16, float32 or float64; got torch.int32"),
        ("y-3D", _call("dot", y=lambda a, d: a["y"][:, :, None]), ValueError, "y", "must be 1-D or 2-D"),
        ("y-narrower", _call("dot", y=lambda a, d: a["y"][:, :2]), ValueError, "y",
         "must have the shape of x (5, 3); got (5, 2)"),
        ("y-fewer-rows", _call("dot", y=lambda a, d: a["y"][:4]), ValueError, "y", "must have the shape of x"),
        ("y-no-columns", _call("dot", y=lambda a, d: a["y"][:, :0]), ValueError, "y",
         "must have non-empty trailing dimensions"),
        ("y-other-device", _call("dot", y=lambda a, d: a["y"].to("meta")), ValueError, "y", "must be on x's device"),
    ],
    "mul": [
        ("y-list", _call("mul", y=lambda a, d: a["y"].tolist()), TypeError, "y", "must be a torch.Tensor"),
        ("y-int", _call("mul", y=lambda a, d: a["y"].long()), TypeError, "y", "got torch.int64"),
        ("y-3D", _call("mul", y=lambda a, d: a["y"][:, :, None]), ValueError, "y", "must be 1-D or 2-D"),
        ("y-fewer-rows-than-num_segments", _call("mul", num_segments=3), ValueError, "y",
         "must have num_segments (3) rows; got shape (2, 3)"),
        ("y-more-rows-than-num_segments", _call("mul", y=lambda a, d: torch.cat([a["y"], a["y"][:1]])), ValueError,
         "y", "must have num_segments (2) rows; got shape (3, 3)"),
        ("y-narrower", _call("mul", y=lambda a, d: a["y"][:, :2]), ValueError, "y",
         "must have shape (2, 3) or (2,); got (2, 2)"),
        ("y-2D-for-1D-x", _call("mul", x=lambda a, d: a["x"][:, 0]), ValueError, "y", "must have shape (2,) or (2,)"),
        ("y-no-columns", _call("mul", y=lambda a, d: a["y"][:, :0]), ValueError, "y",
         "must have non-empty trailing dimensions"),
        ("y-other-device", _call("mul", y=lambda a, d: a["y"].to("meta")), ValueError, "y", "must be on x's device"),
    ],
    "matvec": [
        ("m-list", _call("matvec", m=lambda a, d: a["m"].tolist()), TypeError, "m", "must be a torch.Tensor"),
        ("m-int", _call("matvec", m=lambda a, d: a["m"].int()), TypeError, "m", "got torch.int32"),
        ("m-2D", _call("matvec", m=lambda a, d: a["m"].flatten(1)), ValueError, "m", "must be 3-D; got shape (2, 12)"),
        ("m-fewer-than-num_segments", _call("matvec", m=lambda a, d: a["m"][:1]), ValueError, "m",
         "must have num_segments (2) matrices; got shape (1, 3, 4)"),
        ("m-more-than-num_segments", _call("matvec", m=lambda a, d: torch.cat([a["m"], a["m"][:1]])), ValueError,
         "m", "must have num_segments (2) matrices; got shape (3, 3, 4)"),
        ("m-rows-not-v-columns", _call("matvec", m=lambda a, d: a["m"][:, :2]), ValueError, "m",
         "must have shape (2, 3, K) to match v's 3 columns; got (2, 2, 4)"),
        ("m-no-columns", _call("matvec", m=lambda a, d: a["m"][:, :, :0]), ValueError, "m",
         "must have non-empty trailing dimensions"),
        ("m-other-device", _call("matvec", m=lambda a, d: a["m"].to("meta")), ValueError, "m", "must be on v's device"),
    ],
}

#: One table per operation.
BAD_INPUTS = {op: _index_rows(op) + _SECOND_ROWS.get(op, []) for op in FUNCTIONS}


def test_each_table_covers_every_argument_of_its_operation():
    for op, rows in BAD_INPUTS.items():
        assert {row[3] for row in rows} == set(SIGNATURES[op]), op
        names = [row[0] for row in rows]
        assert len(names) == len(set(names)), op


@pytest.mark.parametrize("strict", [False, True], ids=["default", "strict"])
@pytest.mark.parametrize("op, call, error, argument, words", [
    pytest.param(op, *row[1:], id=f"{op}-{row[0]}") for op, rows in BAD_INPUTS.items() for row in rows])
def test_bad_input(op, call, error, argument, words, device, strict):
    """Each bad input raises its error: in strict mode (and for CPU tensors) within the
    call, otherwise no later than ``check_errors``; and nothing is left to report after."""
    arguments = good_arguments(op, device)
    with pytest.raises(error, match=re.escape(words)) as raised, pk.strict_checks(strict):
        call(arguments, device)
        if not strict:
            pk.check_errors()
    message = str(raised.value)
    assert message.startswith(f"{argument} ") or message.startswith(f"segmented_{op}: {argument} "), message
    pk.check_errors()


@pytest.mark.parametrize("op", list(FUNCTIONS))
def test_good_arguments_give_the_reference(op, device):
    """The call every row spoils is itself good: the float64 NumPy loops' result."""
    arguments = good_arguments(op, device)
    tensors = [arguments[name] for name in SIGNATURES[op][:-2]]
    assert_close(f"{op} of the good arguments", FUNCTIONS[op](**arguments),
                 numpy_forward(op, tensors, arguments["idx"], 2), atol=1e-6, rtol=1e-6)


# --- the idx check on the device: one kernel, which reports and clamps --------------------------

def _violations(values, num_segments):
    """Where a list of segment ids breaks each rule: ``(out of range, descents)``."""
    outside = {i for i, v in enumerate(values) if not 0 <= v < num_segments}
    descents = {i for i in range(1, len(values)) if values[i] < values[i - 1]}
    return outside, descents


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
def test_idx_check_kernel_reports_a_true_violation_and_clamps(dtype, device):
    """``idx_check_triton`` (what every call on the kernels' device runs) against the rules
    counted in Python: the int32 copy is ``idx`` clamped to ``[0, S)``, and what it reports
    is a real violation (its code and row), or nothing for a good ``idx``. Sorted and
    unsorted, negative, beyond int32 (int64), one entry, and descents at the first and last
    entries and on both sides of a block edge (blocks of 4096 entries, several programs)."""
    from packed_kernels import validation

    S = 3000
    in_range, in_order = validation.value_check("test", "idx", "in range"), validation.value_check(
        "test", "idx", "sorted")
    g = torch.Generator().manual_seed(17)
    sorted_long = torch.sort(torch.randint(0, S, (9001,), generator=g)).values.tolist()
    cases = [[0], [5], [-3], [S], [0, 0, 1, 1, 2], [2, 1, 0], [-4, -4, 0, 7], [1, 0, 0, 3], [0, 1, 2, 1],
             sorted_long]
    for position in (1, 4095, 4096, 4097, 8192, 9000):
        spoiled = list(sorted_long)
        spoiled[position] = spoiled[position - 1] - 1
        cases.append(spoiled)
    spoiled = list(sorted_long)
    spoiled[6000] = S + 5  # out of range and a descent after it: one block, the range wins
    cases.append(spoiled)
    if dtype == torch.int64:
        cases += [[0, 2 ** 32 + 1], [-2 ** 63, 0, 2 ** 63 - 1], [2 ** 40, 1]]
    else:
        cases += [[-2 ** 31, 2 ** 31 - 1], [2 ** 31 - 1, -2 ** 31]]
    pk.check_errors()
    for values in cases:
        idx = torch.tensor(values, dtype=dtype, device=device)
        out = tk.idx_check_triton(idx, S, in_range.code, in_order.code)
        assert out.dtype == torch.int32 and out.tolist() == [min(max(v, 0), S - 1) for v in values], values[:8]
        outside, descents = _violations(values, S)
        try:
            pk.check_errors()
        except ValueError as error:
            message = str(error)
            row = int(message.rsplit(" ", 1)[1])
            if message.startswith("test: idx in range"):
                assert row in outside, (values[:8], message)
            else:
                assert message.startswith("test: idx sorted") and row in descents, (values[:8], message)
                assert not outside or min(outside) // 4096 != row // 4096, (values[:8], message)
        else:
            assert not outside and not descents, values[:8]


@pytest.mark.parametrize("op, call, error, argument, words", [
    pytest.param(op, *row[1:], id=f"{op}-{row[0]}") for op, rows in BAD_INPUTS.items() for row in rows
    if row[3] == "idx" and op in ("sum", "mul")])
def test_bad_idx_of_the_padded_stage(op, call, error, argument, words, device, monkeypatch):
    """The bad ``idx`` rows again, for tensors the kernels do not take (checked on the host,
    then computed by the padded stage): the same errors, at once."""
    from packed_kernels import runtime

    monkeypatch.setattr(runtime, "on_kernel_device", lambda tensor: tensor.device.type == "meta")
    if device != "cpu":
        pytest.skip("the padded stage takes CPU tensors")
    with pytest.raises(error, match=re.escape(words)) as raised:
        call(good_arguments(op, device), device)
    message = str(raised.value)
    assert message.startswith(f"{argument} ") or message.startswith(f"segmented_{op}: {argument} "), message
