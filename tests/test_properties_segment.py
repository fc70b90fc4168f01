"""Property tests of the six segment operations against float64 references.

Random segment lengths (empty segments, empty inputs, one-row segments), row widths
(1-D rows and ``(N, D)``), dtypes (two inputs of two dtypes are promoted), layouts
(transposed, sliced and expanded views) and ``idx`` of int32 or int64, possibly strided.
Each example checks the output, the first derivatives of a random projection of it
and the second derivatives (``grad`` of a random projection of the first gradient,
``create_graph=True``) against :mod:`tests.references` through autograd; and two
identical calls give the same bits, as the operations promise.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import packed_kernels as pk
from tests.assertions import assert_close
from tests.references import (
    LAYOUTS,
    as_layout,
    property_settings,
    rounded,
    segmented_dot_reference,
    segmented_matvec_reference,
    segmented_mean_reference,
    segmented_mul_reference,
    segmented_rms_norm_reference,
    segmented_sum_reference,
)

FUNCTIONS = {
    "sum": (pk.segmented_sum, segmented_sum_reference),
    "mean": (pk.segmented_mean, segmented_mean_reference),
    "dot": (pk.segmented_dot, segmented_dot_reference),
    "mul": (pk.segmented_mul, segmented_mul_reference),
    "rms_norm": (pk.segmented_rms_norm, segmented_rms_norm_reference),
    "matvec": (pk.segmented_matvec, segmented_matvec_reference),
}

#: Tolerance (atol = rtol) by dtype: float16 and bfloat16 compute in float32 and round
#: each result; second derivatives, which chain two rounded results, get twice as much.
TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
DTYPES = list(TOLERANCE)


@dataclass(frozen=True)
class SegmentCase:
    """One call: ``lengths[s]`` rows in segment ``s``; the inputs' shapes, dtypes and layouts."""

    op: str
    lengths: Tuple[int, ...]
    width: Optional[int]  # None: 1-D rows
    columns: int  # K of matvec's (S, D, K) matrices
    broadcast: bool  # mul: one factor per segment, y of shape (S,)
    dtypes: Tuple[torch.dtype, ...]
    layouts: Tuple[str, ...]
    idx_dtype: torch.dtype
    strided_idx: bool
    zero_segment: Optional[int]  # rms_norm: a segment whose rows are all zero
    seed: int

    @property
    def num_segments(self) -> int:
        return len(self.lengths)

    @property
    def rows(self) -> int:
        return sum(self.lengths)

    def shapes(self):
        N, S, D = self.rows, self.num_segments, self.width
        row = (N,) if D is None else (N, D)
        if self.op in ("sum", "mean", "rms_norm"):
            return [row]
        if self.op == "dot":
            return [row, row]
        if self.op == "mul":
            return [row, (S,) if self.broadcast or D is None else (S, D)]
        return [(N, D), (S, D, self.columns)]


@st.composite
def segment_cases(draw, op: str, dtype: torch.dtype) -> SegmentCase:
    """A random call of ``op`` whose first input is of ``dtype``."""
    lengths = tuple(draw(st.lists(st.integers(0, 4), min_size=1, max_size=5)))  # no segments: an edge case
    width = draw(st.sampled_from([1, 3, 4]) if op == "matvec" else st.one_of(st.none(), st.integers(1, 4)))
    inputs = 1 if op in ("sum", "mean", "rms_norm") else 2
    dtypes = (dtype,)
    if inputs == 2:  # mostly one dtype; a third of the cases promote two
        dtypes += (draw(st.sampled_from(DTYPES)) if draw(st.sampled_from([False, False, True])) else dtypes[0],)
    layouts = tuple(draw(st.sampled_from(LAYOUTS)) for _ in range(inputs))
    zero_segment = None
    if op == "rms_norm" and lengths and draw(st.booleans()):
        zero_segment = draw(st.integers(0, len(lengths) - 1))
    return SegmentCase(
        op=op, lengths=lengths, width=width, columns=draw(st.integers(1, 3)),
        broadcast=op == "mul" and width is not None and draw(st.booleans()),
        dtypes=dtypes, layouts=layouts, idx_dtype=draw(st.sampled_from([torch.int32, torch.int64])),
        strided_idx=draw(st.booleans()), zero_segment=zero_segment, seed=draw(st.integers(0, 2 ** 31 - 1)),
    )


def segment_ids(case: SegmentCase, device) -> torch.Tensor:
    """``idx`` written out by hand: ``lengths[s]`` copies of ``s``, as a strided view when asked."""
    ids = [s for s, n in enumerate(case.lengths) for _ in range(n)]
    idx = torch.tensor(ids, dtype=case.idx_dtype, device=device)
    if case.strided_idx:
        idx = torch.stack([idx, torch.full_like(idx, -1)], dim=1).flatten()[::2]  # stride 2, junk between
    return idx


def leaf_values(case: SegmentCase):
    """float64 values of each input, rounded to its dtype, and the generator that
    draws the projections next."""
    g = torch.Generator().manual_seed(case.seed)
    values = [rounded(torch.randn(shape, generator=g, dtype=torch.float64), dtype)
              for shape, dtype in zip(case.shapes(), case.dtypes)]
    if case.zero_segment is not None:
        start = sum(case.lengths[: case.zero_segment])
        values[0][start:start + case.lengths[case.zero_segment]] = 0.0
    return values, g


def derivatives(function, leaves, layouts, idx, num_segments, projection, cotangents):
    """``(out, first, second)``: the output, ``d <out, projection> / d leaf`` and
    ``d <first, cotangents> / d leaf`` for every leaf (zeros where a derivative is absent)."""
    out = function(*(as_layout(leaf, layout) for leaf, layout in zip(leaves, layouts)), idx, num_segments)
    first = torch.autograd.grad((out * projection.to(out.dtype)).sum(), leaves, create_graph=True,
                                allow_unused=True)
    first = [torch.zeros_like(leaf) if f is None else f for leaf, f in zip(leaves, first)]
    inner = sum((f * c.to(f.dtype)).sum() for f, c in zip(first, cotangents))
    if inner.requires_grad:
        second = torch.autograd.grad(inner, leaves, allow_unused=True)
    else:  # the first derivatives do not depend on the inputs (a linear operation)
        second = [None] * len(leaves)
    second = [torch.zeros_like(leaf) if s is None else s for leaf, s in zip(leaves, second)]
    return out.detach(), [f.detach() for f in first], second


def check_segment_operation(case: SegmentCase, device: str) -> None:
    function, reference = FUNCTIONS[case.op]
    values, g = leaf_values(case)
    idx = segment_ids(case, device)
    promoted = case.dtypes[0] if len(case.dtypes) == 1 else torch.promote_types(*case.dtypes)
    tol = max(TOLERANCE[dtype] for dtype in case.dtypes)

    leaves = [v.to(device=device, dtype=dtype).requires_grad_() for v, dtype in zip(values, case.dtypes)]
    expected_leaves = [v.clone().requires_grad_() for v in values]
    out_shape = reference(*(as_layout(v, layout) for v, layout in zip(values, case.layouts)), idx.cpu(),
                          case.num_segments).shape
    projection = rounded(torch.randn(out_shape, generator=g, dtype=torch.float64), promoted)
    cotangents = [rounded(torch.randn(v.shape, generator=g, dtype=torch.float64), dtype)
                  for v, dtype in zip(values, case.dtypes)]

    out, first, second = derivatives(function, leaves, case.layouts, idx, case.num_segments,
                                     projection.to(device), [c.to(device) for c in cotangents])
    want_out, want_first, want_second = derivatives(reference, expected_leaves, case.layouts, idx.cpu(),
                                                    case.num_segments, projection, cotangents)

    assert out.dtype == promoted, f"{case.op}: output dtype {out.dtype}, expected {promoted}"
    assert_close(f"{case.op} output", out, want_out, atol=tol, rtol=tol)
    for k, (got, want, dtype) in enumerate(zip(first, want_first, case.dtypes)):
        assert got.dtype == dtype, f"{case.op}: gradient of input {k} has dtype {got.dtype}, expected {dtype}"
        assert_close(f"{case.op} d/d input {k}", got, want, atol=tol, rtol=tol)
    for k, (got, want) in enumerate(zip(second, want_second)):
        assert_close(f"{case.op} second derivative, input {k}", got, want, atol=2 * tol, rtol=2 * tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", sorted(FUNCTIONS))
@property_settings(max_examples=5)
@given(data=st.data())
def test_segment_operation_matches_reference(device, op, dtype, data):
    check_segment_operation(data.draw(segment_cases(op, dtype), label="case"), device)


EVERY_SEGMENT_EMPTY = dict(lengths=(0, 0, 0), width=2, columns=2, broadcast=False, idx_dtype=torch.int32,
                           strided_idx=False, zero_segment=None, seed=1)
EDGES = {
    "every-segment-empty": EVERY_SEGMENT_EMPTY,
    "no-segments": dict(EVERY_SEGMENT_EMPTY, lengths=()),
    "one-row-segments": dict(EVERY_SEGMENT_EMPTY, lengths=(1, 0, 1, 1), idx_dtype=torch.int64, strided_idx=True),
    # rms_norm's first segment all zero rows: 0, with zero derivatives
    "1-D-rows": dict(EVERY_SEGMENT_EMPTY, lengths=(2, 1), width=None, zero_segment=0),
}


@pytest.mark.parametrize("edge", sorted(EDGES))
@pytest.mark.parametrize("op", sorted(FUNCTIONS))
def test_segment_operation_on_edge_cases(device, op, edge):
    inputs = 1 if op in ("sum", "mean", "rms_norm") else 2
    fields = dict(EDGES[edge], zero_segment=EDGES[edge]["zero_segment"] if op == "rms_norm" else None)
    if op == "matvec" and fields["width"] is None:
        fields["width"] = 3  # matvec rows are (N, D)
    case = SegmentCase(op=op, dtypes=(torch.float64,) * inputs, layouts=("contiguous",) * inputs, **fields)
    check_segment_operation(case, device)


@pytest.mark.parametrize("op", sorted(FUNCTIONS))
@property_settings(max_examples=2)
@given(dtype=st.sampled_from(DTYPES), data=st.data())
def test_segment_operation_is_bitwise_deterministic(device, op, dtype, data):
    """The same call twice gives the same bits: output, first and second derivatives."""
    case = data.draw(segment_cases(op, dtype), label="case")
    values, _ = leaf_values(case)
    idx = segment_ids(case, device)
    function = FUNCTIONS[op][0]
    runs = []
    for _ in range(2):
        leaves = [v.to(device=device, dtype=kind).requires_grad_() for v, kind in zip(values, case.dtypes)]
        probe = function(*(as_layout(leaf, layout) for leaf, layout in zip(leaves, case.layouts)), idx,
                         case.num_segments)
        projection = torch.linspace(-1, 1, probe.numel(), dtype=probe.dtype, device=device).reshape(probe.shape)
        cotangents = [torch.linspace(1, -1, v.numel(), dtype=torch.float64).reshape(v.shape).to(device) for v in values]
        runs.append(derivatives(function, leaves, case.layouts, idx, case.num_segments, projection, cotangents))
    (out_a, first_a, second_a), (out_b, first_b, second_b) = runs
    assert torch.equal(out_a, out_b), f"{op}: outputs differ between two identical calls"
    for a, b in zip(first_a + second_a, first_b + second_b):
        assert torch.equal(a, b), f"{op}: derivatives differ between two identical calls"
