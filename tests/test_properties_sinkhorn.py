"""Property tests of ``sinkhorn`` and ``sinkhorn_backward`` against float64 references.

What each backward promises (see the docstrings) decides its reference:

* ``backward="unrolled"`` is the exact gradient of the ``iters``-step map: autograd
  through :func:`tests.references.sinkhorn_reference`, the plain alternating loop in
  float64, for any ``iters``.
* ``backward="implicit"`` and ``sinkhorn_backward`` solve the weighted implicit system
  at the ``R`` they are given, whatever ``iters`` produced it:
  :func:`tests.references.sinkhorn_implicit_reference` solves it by the pseudo-inverse.
  Once the iterations have converged, that is the gradient of the limit: autograd through
  the float64 loop run to convergence.

Values stay at ordinary scales (logits of about unit size); random matrix sizes ``n``
from 1 to 5 (both kernel layouts), leading dims (none, one, two, an empty one), four
dtypes and strided views.
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
    sinkhorn_implicit_reference,
    sinkhorn_reference,
)

#: Tolerance (atol = rtol) of ``R`` by dtype (float16 and bfloat16 compute in float32
#: and round the result) and of the gradients, whose implicit form reads the rounded
#: ``R``. float32 leaves room for the GPU's approximate reciprocals.
FORWARD_TOLERANCE = {torch.float64: 1e-12, torch.float32: 5e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
GRADIENT_TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
DTYPES = list(FORWARD_TOLERANCE)


@dataclass(frozen=True)
class SinkhornCase:
    """One call: ``leading + (n, n)`` logits of a dtype and layout."""

    leading: Tuple[int, ...]
    n: int
    iters: int
    dtype: torch.dtype
    layout: str
    cg_iters: Optional[int]
    seed: int

    @property
    def shape(self):
        return self.leading + (self.n, self.n)


@st.composite
def sinkhorn_cases(draw, dtype: torch.dtype, iters=st.integers(1, 6), cg=False) -> SinkhornCase:
    """Random ``leading + (n, n)`` logits of ``dtype``, ``n`` from 1 to 5; ``cg``: a
    conjugate-gradient count of ``2n`` (or the direct solve) for the implicit backward."""
    n = draw(st.integers(1, 5))
    return SinkhornCase(
        leading=tuple(draw(st.lists(st.integers(1, 3), max_size=2))), n=n, iters=draw(iters),
        dtype=dtype, layout=draw(st.sampled_from(LAYOUTS)),
        cg_iters=draw(st.sampled_from([None, 2 * n])) if cg else None, seed=draw(st.integers(0, 2 ** 31 - 1)),
    )


def random_values(case: SinkhornCase, low: Optional[float] = None):
    """Logits (unit normal, or uniform in ``[low, -low]``) and an upstream gradient, float64
    rounded to the case's dtype."""
    g = torch.Generator().manual_seed(case.seed)
    if low is None:
        logits = torch.randn(case.shape, generator=g, dtype=torch.float64)
    else:
        logits = low * (1 - 2 * torch.rand(case.shape, generator=g, dtype=torch.float64))
    grad_R = torch.randn(case.shape, generator=g, dtype=torch.float64)
    return rounded(logits, case.dtype), rounded(grad_R, case.dtype)


def package_forward_and_gradient(case: SinkhornCase, device, logits, grad_R, backward):
    leaf = logits.to(device=device, dtype=case.dtype).requires_grad_()
    R = pk.sinkhorn(as_layout(leaf, case.layout), case.iters, backward=backward, cg_iters=case.cg_iters)
    R.backward(grad_R.to(device=device, dtype=case.dtype))
    return R.detach(), leaf.grad


def edge_case(**fields) -> SinkhornCase:
    base = dict(leading=(2,), n=3, iters=3, dtype=torch.float64, layout="contiguous", cg_iters=None, seed=11)
    return SinkhornCase(**{**base, **fields})


#: One 1x1 matrix (R = 1, gradient 0), an empty batch, a single 4x4 matrix (the
#: one-matrix-per-thread kernels) after one iteration.
EDGE_CASES = {"one-by-one": edge_case(leading=(), n=1), "empty-batch": edge_case(leading=(0,)),
              "single-4x4-one-iteration": edge_case(leading=(), n=4, iters=1)}


def check_unrolled(case: SinkhornCase, device) -> None:
    """``R`` and ``backward="unrolled"``'s gradient are the ``iters``-step map's and its exact gradient."""
    logits, grad_R = random_values(case)
    R, grad = package_forward_and_gradient(case, device, logits, grad_R, "unrolled")
    leaf = logits.clone().requires_grad_()
    want_R = sinkhorn_reference(as_layout(leaf, case.layout), case.iters)
    (want_grad,) = torch.autograd.grad(want_R, leaf, grad_R) if leaf.numel() else (torch.zeros_like(leaf),)
    assert R.dtype == grad.dtype == case.dtype, f"dtypes {R.dtype}, {grad.dtype}; expected {case.dtype}"
    assert_close("R", R, want_R, atol=FORWARD_TOLERANCE[case.dtype], rtol=FORWARD_TOLERANCE[case.dtype])
    assert_close("unrolled gradient", grad, want_grad, atol=GRADIENT_TOLERANCE[case.dtype],
                 rtol=GRADIENT_TOLERANCE[case.dtype])


def check_implicit(case: SinkhornCase, device) -> None:
    """``backward="implicit"`` after any ``iters``: the weighted implicit system at the
    computed ``R`` (direct solve, or ``2n`` conjugate-gradient steps)."""
    logits, grad_R = random_values(case)
    R, grad = package_forward_and_gradient(case, device, logits, grad_R, "implicit")
    leaf = logits.clone().requires_grad_()
    view = as_layout(leaf, case.layout)
    want_R = sinkhorn_reference(view.detach(), case.iters)
    # the backward reads R as the forward returned it: in the case's dtype
    grad_view = sinkhorn_implicit_reference(rounded(want_R, case.dtype), grad_R)
    (want_grad,) = torch.autograd.grad(view, leaf, grad_view) if leaf.numel() else (torch.zeros_like(leaf),)
    assert R.dtype == grad.dtype == case.dtype, f"dtypes {R.dtype}, {grad.dtype}; expected {case.dtype}"
    assert_close("R", R, want_R, atol=FORWARD_TOLERANCE[case.dtype], rtol=FORWARD_TOLERANCE[case.dtype])
    assert_close("implicit gradient", grad, want_grad, atol=GRADIENT_TOLERANCE[case.dtype],
                 rtol=GRADIENT_TOLERANCE[case.dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@property_settings(max_examples=4)
@given(data=st.data())
def test_sinkhorn_unrolled_matches_autograd_through_the_loop(device, dtype, data):
    check_unrolled(data.draw(sinkhorn_cases(dtype), label="case"), device)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@property_settings(max_examples=4)
@given(data=st.data())
def test_sinkhorn_implicit_gradient_solves_the_system_at_R(device, dtype, data):
    check_implicit(data.draw(sinkhorn_cases(dtype, cg=True), label="case"), device)


@pytest.mark.parametrize("edge", sorted(EDGE_CASES))
def test_sinkhorn_on_edge_cases(device, edge):
    check_unrolled(EDGE_CASES[edge], device)
    check_implicit(EDGE_CASES[edge], device)


#: Iterations after which logits in [-1, 1] with n <= 5 have converged to float64
#: rounding (the column sums within 1e-12 of 1 after at most about 30).
CONVERGED_ITERS = 40


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@property_settings(max_examples=4)
@given(data=st.data())
def test_sinkhorn_implicit_gradient_is_the_gradient_of_the_limit(device, dtype, data):
    """Converged, the implicit gradient is autograd's through the float64 loop run far longer."""
    case = data.draw(sinkhorn_cases(dtype, iters=st.just(CONVERGED_ITERS), cg=True), label="case")
    logits, grad_R = random_values(case, low=1.0)
    R, grad = package_forward_and_gradient(case, device, logits, grad_R, "implicit")
    leaf = logits.clone().requires_grad_()
    limit = sinkhorn_reference(as_layout(leaf, case.layout), 8 * CONVERGED_ITERS)
    (want_grad,) = torch.autograd.grad(limit, leaf, grad_R) if leaf.numel() else (torch.zeros_like(leaf),)
    assert_close("converged R", R, limit, atol=FORWARD_TOLERANCE[case.dtype], rtol=FORWARD_TOLERANCE[case.dtype])
    assert_close("implicit gradient vs the limit's", grad, want_grad, atol=GRADIENT_TOLERANCE[case.dtype],
                 rtol=GRADIENT_TOLERANCE[case.dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@property_settings(max_examples=4)
@given(grad_dtype=st.sampled_from(DTYPES), grad_layout=st.sampled_from(LAYOUTS), data=st.data())
def test_sinkhorn_backward_solves_the_system_at_any_R(device, dtype, grad_dtype, grad_layout, data):
    """``sinkhorn_backward(R, grad_R)`` on ``R`` that is doubly stochastic or not (few
    iterations), ``grad_R`` of any dtype (cast to ``R``'s first) and any layout."""
    case = data.draw(sinkhorn_cases(dtype, cg=True), label="case")
    logits, _ = random_values(case)
    g = torch.Generator().manual_seed(case.seed + 1)
    R = rounded(sinkhorn_reference(logits, case.iters), case.dtype)
    grad_R = rounded(torch.randn(case.shape, generator=g, dtype=torch.float64), grad_dtype)
    got = pk.sinkhorn_backward(as_layout(R.to(device=device, dtype=case.dtype), case.layout),
                               as_layout(grad_R.to(device=device, dtype=grad_dtype), grad_layout), case.cg_iters)
    want = sinkhorn_implicit_reference(as_layout(R, case.layout),
                                       rounded(as_layout(grad_R, grad_layout), case.dtype))
    assert got.dtype == case.dtype, f"dtype {got.dtype}, expected {case.dtype}"
    tol = GRADIENT_TOLERANCE[case.dtype]
    assert_close("sinkhorn_backward", got, want, atol=tol, rtol=tol)
