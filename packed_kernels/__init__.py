"""packed_kernels: Triton kernels over packed (token-flat, padding-free) data.

Importing the package picks where the kernels run (see :mod:`packed_kernels.runtime`):
compiled on a CUDA GPU, or through Triton's interpreter on the CPU when no GPU is
visible. Each algorithm lives in its own subpackage with its three stages side by
side: ``naive_numpy`` (a float64 reference), ``padded_torch`` (vectorised PyTorch
over a padded batch) and ``triton_kernels`` (the production path). Its public
functions are importable from here; a subpackage is loaded the first time one of its
names is used, so ``import packed_kernels`` stays cheap.
"""
import importlib as _importlib
from typing import TYPE_CHECKING

from . import runtime  # must come first: it decides compile vs interpret for @triton.jit
from . import packing as _packing
from .packing import *  # noqa: F401,F403  (Packed, pack, unpack, offsets and segment ids)
from .validation import check_errors, set_strict_checks, strict_checks

__version__ = "0.1.0"

# public name -> the subpackage that defines it
_LAZY_NAMES = {
    "packed_ctc_loss": "ops.ctc",
    "packed_ctc_loss_from_logits": "ops.ctc",
    "linear_packed_ctc_loss": "ops.ctc",
    "packed_ctc_align": "ops.ctc",
    "packed_ctc_align_from_logits": "ops.ctc",
    "CTCAlignment": "ops.ctc",
    "sinkhorn": "ops.sinkhorn",
    "sinkhorn_backward": "ops.sinkhorn",
    "segmented_sum": "ops.segment",
    "segmented_mean": "ops.segment",
    "segmented_dot": "ops.segment",
    "segmented_mul": "ops.segment",
    "segmented_rms_norm": "ops.segment",
    "segmented_matvec": "ops.segment",
    "PersistentLSTM": "ops.lstm",
}

if TYPE_CHECKING:  # what the lazy names below resolve to, for type checkers and IDEs
    from .ops.ctc import (CTCAlignment, linear_packed_ctc_loss, packed_ctc_align, packed_ctc_align_from_logits,
                          packed_ctc_loss, packed_ctc_loss_from_logits)
    from .ops.lstm import PersistentLSTM
    from .ops.segment import *  # noqa: F401,F403  (the six segmented_* functions)
    from .ops.sinkhorn import sinkhorn, sinkhorn_backward

__all__ = [*_packing.__all__, "check_errors", "set_strict_checks", "strict_checks", *_LAZY_NAMES]


def __getattr__(name):
    if name in _LAZY_NAMES:
        module = _importlib.import_module(f".{_LAZY_NAMES[name]}", __name__)
        value = getattr(module, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
