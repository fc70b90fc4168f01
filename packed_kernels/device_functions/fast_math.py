"""Small arithmetic helpers shared by the Triton kernels."""
from __future__ import annotations

import triton
import triton.language as tl

from .. import runtime  # noqa: F401  (decides interpret vs compile before @triton.jit)


@triton.jit
def reciprocal(x, FAST: tl.constexpr):
    """``1 / x`` of a float32 tensor.

    With ``FAST`` (compiled code only: the interpreter runs no PTX) it is one
    ``rcp.approx.ftz.f32``, a single special-function instruction within 1 ulp, where
    ``1.0 / x`` costs several instructions.
    """
    if FAST:
        return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [x],
                                         dtype=tl.float32, is_pure=True, pack=1)
    else:
        return 1.0 / x


@triton.jit
def exp(x, FAST: tl.constexpr):
    """``e^x`` of a float32 tensor.

    With ``FAST`` (compiled code only) it is one multiply and one
    ``ex2.approx.ftz.f32``: results below the normal range flush to zero, where
    ``tl.exp`` adds a range test and a rescaling around the same instruction.
    """
    if FAST:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [x * 1.4426950408889634],
                                         dtype=tl.float32, is_pure=True, pack=1)
    else:
        return tl.exp(x)
