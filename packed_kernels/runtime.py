"""Where the Triton kernels run: compiled on a CUDA GPU, or interpreted on the CPU.

Triton decides between compiling a kernel and interpreting it when the kernel is
decorated with ``@triton.jit``, from the environment variable ``TRITON_INTERPRET``.
This module is imported before any kernel module of the package, and sets that
variable when no CUDA GPU is visible, so that ``import packed_kernels`` works on a
laptop or a CPU-only CI machine with no set-up: the very same kernels then run
through Triton's interpreter on CPU tensors (slowly, one program of the grid after
another, but with the same results).

An explicit ``TRITON_INTERPRET`` chosen by the user is respected either way. Importing
the package after triton (or after ``torch._dynamo`` or a ``torch.compile`` call, which
import it) works too: Triton's own library functions are then switched to the
interpreter as well.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import os
import sys
from typing import Optional

import torch



def _interpret_triton_language() -> int:
    """Turn the ``@triton.jit`` functions of ``triton.language`` that were decorated in
    compiled mode (``tl.sum``, ``tl.max``, ``tensor.sum``, ...) into interpreted ones.

    Triton picks compile or interpret when a function is decorated. When triton was
    imported before the interpreter was switched on (directly, or through
    ``torch._dynamo`` or a ``torch.compile`` call), its library functions are compiled
    ones, which an interpreted kernel cannot call. Returns how many were converted.
    """
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    def interpreted(function):
        options = {key: getattr(function, attr) for key, attr in (
            ("version", "version"), ("do_not_specialize", "do_not_specialize"),
            ("do_not_specialize_on_alignment", "do_not_specialize_on_alignment"), ("debug", "debug"),
            ("noinline", "noinline"), ("repr", "_repr"), ("launch_metadata", "launch_metadata"),
        ) if hasattr(function, attr)}
        try:
            return InterpretedFunction(function.fn, **options)
        except TypeError:  # a Triton release whose constructor takes fewer options
            return InterpretedFunction(function.fn)

    namespaces = [module for name, module in list(sys.modules.items())
                  if module is not None and (name == "triton.language" or name.startswith("triton.language."))]
    converted = 0
    for namespace in [*namespaces, tl.tensor]:
        for name, value in list(vars(namespace).items()):
            if type(value) is JITFunction:
                setattr(namespace, name, interpreted(value))
                converted += 1
    return converted


if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
    if "triton" in sys.modules:
        _interpret_triton_language()

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


def on_kernel_device(tensor: torch.Tensor) -> bool:
    """Whether the kernels take ``tensor``: it lives on :data:`KERNEL_DEVICE`, or on the
    ``meta`` device (shapes only). A CPU tensor on a machine whose kernels are compiled
    for the GPU is not: the public functions compute it through their padded PyTorch
    stage instead (the persistent LSTM through the ``nn.LSTM`` it wraps)."""
    return tensor.device.type == KERNEL_DEVICE or tensor.device.type == "meta"


def autocast_enabled(device_type: str) -> bool:
    """Whether autocast is on for ``device_type`` (False for a type without autocast, ``meta``).

    While ``torch.compile`` traces, the tensors live on a device that has autocast, and
    ``torch.amp.is_autocast_available`` is not traceable by every supported release."""
    if torch.compiler.is_compiling():
        return torch.is_autocast_enabled(device_type)
    return torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type)


def without_autocast(device_type: str):
    """A context with autocast off on ``device_type`` (nothing for a type without autocast)."""
    if torch.compiler.is_compiling() or torch.amp.is_autocast_available(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()
