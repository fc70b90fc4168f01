"""Segment operations over sorted segment ids, differentiable to second order.

Three stages side by side: :mod:`.naive_numpy` (loops over segments, with the
hand-derived first and second derivatives), :mod:`.padded_torch` (pad each segment
to a dense block; autograd gives both orders) and the Triton kernels
(:mod:`.triton_kernels`, registered as custom operators in :mod:`.custom_ops`), which
the public functions below use.
"""
from .api import (
    segmented_dot,
    segmented_matvec,
    segmented_mean,
    segmented_mul,
    segmented_rms_norm,
    segmented_sum,
)

__all__ = [
    "segmented_sum",
    "segmented_mean",
    "segmented_dot",
    "segmented_mul",
    "segmented_rms_norm",
    "segmented_matvec",
]
