"""Segment operations over sorted segment ids, differentiable to second order.

Three stages side by side: :mod:`.naive_numpy` (loops over segments, with the
hand-derived first and second derivatives: ``segmented_sum_numpy``, ...),
:mod:`.padded_torch` (pad each segment to a dense block; autograd gives both orders:
``segmented_sum_padded``, ...) and the Triton kernels (:mod:`.triton_kernels`, their
launchers ``*_triton``), registered as operators in :mod:`.api`, which holds the public
functions below.
"""
from . import api
from .api import (
    segmented_dot,
    segmented_matvec,
    segmented_mean,
    segmented_mul,
    segmented_rms_norm,
    segmented_sum,
)

__all__ = list(api.__all__)
