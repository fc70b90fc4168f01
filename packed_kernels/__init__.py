"""packed_kernels: Triton kernels over packed (token-flat, padding-free) data.

Importing the package picks where the kernels run (see :mod:`packed_kernels.runtime`):
compiled on a CUDA GPU, or through Triton's interpreter on the CPU when no GPU is
visible. Each algorithm lives in its own subpackage with its three stages side by
side: ``naive_numpy`` (a float64 reference), ``padded_torch`` (vectorised PyTorch
over a padded batch) and ``triton_kernels`` (the production path, re-exported here).
"""
from . import runtime  # must come first: it decides compile vs interpret for @triton.jit
from .packing import Packed, cu_seqlens_from_lengths, pack, unpack

from . import ctc, lstm, segment_ops, sinkhorn  # noqa: E402  (after runtime)
from .ctc import *  # noqa: E402,F401,F403
from .lstm import *  # noqa: E402,F401,F403
from .segment_ops import *  # noqa: E402,F401,F403
from .sinkhorn import *  # noqa: E402,F401,F403

__version__ = "0.1.0"
__all__ = (
    ["Packed", "pack", "unpack", "cu_seqlens_from_lengths"]
    + ctc.__all__
    + sinkhorn.__all__
    + segment_ops.__all__
    + lstm.__all__
)
