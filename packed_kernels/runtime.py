"""Where the Triton kernels run: compiled on a CUDA GPU, or interpreted on the CPU.

Triton decides between compiling a kernel and interpreting it when the kernel is
decorated with ``@triton.jit``, from the environment variable ``TRITON_INTERPRET``.
This module is imported before any kernel module of the package, and sets that
variable when no CUDA GPU is visible, so that ``import packed_kernels`` works on a
laptop or a CPU-only CI machine with no set-up: the very same kernels then run
through Triton's interpreter on CPU tensors (slowly, one program of the grid after
another, but with the same results).

An explicit ``TRITON_INTERPRET`` chosen by the user is respected either way.
"""
from __future__ import annotations

import functools
import itertools
import os
import sys
import warnings
from typing import Optional

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    if "triton" in sys.modules:
        # Triton's own library functions (tl.sum, tl.max, ...) were decorated when
        # triton was imported, in compiled mode; interpreted kernels cannot call them.
        warnings.warn(
            "triton was imported before packed_kernels on a machine without a CUDA GPU: "
            "Triton's interpreter may fail inside kernels. Import packed_kernels first, "
            "or set TRITON_INTERPRET=1 before starting Python.",
            RuntimeWarning,
            stacklevel=2,
        )
    os.environ["TRITON_INTERPRET"] = "1"

#: True when the Triton kernels run through the interpreter on CPU tensors.
INTERPRETED: bool = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

#: The device type the kernels take their tensors on: ``"cpu"`` or ``"cuda"``.
KERNEL_DEVICE: str = "cpu" if INTERPRETED else "cuda"


def on_inputs_device(launcher):
    """Run ``launcher`` with its first tensor argument's GPU as the current device.

    Triton launches a kernel on the current CUDA device, so tensors on another GPU
    (``cuda:1`` while ``cuda:0`` is current) would be refused at launch. Switching costs
    nothing when the tensors already live on the current device.
    """

    @functools.wraps(launcher)
    def launch(*args, **kwargs):
        for value in itertools.chain(args, kwargs.values()):
            if isinstance(value, torch.Tensor):
                if value.is_cuda and value.device.index != torch.cuda.current_device():
                    with torch.cuda.device(value.device):
                        return launcher(*args, **kwargs)
                break
        return launcher(*args, **kwargs)

    return launch


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for launch grids: plain Python (``triton.cdiv`` is a Triton
    constexpr function in recent releases, several times slower to call from the host)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two ``>= n`` (0 for 0), as ``triton.next_power_of_2``."""
    return 1 << (int(n) - 1).bit_length() if n > 0 else 0


def sm_count(device: torch.device) -> int:
    """The number of SMs of the CUDA ``device``."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def register_cap(cap: Optional[int]) -> dict:
    """Launch options capping a kernel's registers per thread at ``cap`` (``None``: the
    compiler's choice). Empty under the interpreter, which compiles nothing."""
    return {} if cap is None or INTERPRETED else {"maxnreg": cap}
