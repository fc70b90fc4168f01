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

#: Whether the Triton kernels run through Triton's interpreter, on CPU tensors, rather
#: than compiled for a GPU. Fixed when the package is imported: ``False`` on a machine
#: with a CUDA GPU (the kernels compile and take CUDA tensors), ``True`` on one without
#: (CPU-only CI, a laptop). An explicit ``TRITON_INTERPRET`` in the environment decides
#: either way: ``TRITON_INTERPRET=1`` makes it ``True`` on a GPU machine too.
INTERPRETED: bool = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

#: The device type the kernels take their tensors on, fixed with :data:`INTERPRETED`:
#: ``"cuda"`` on a machine with a CUDA GPU, ``"cpu"`` on one without (or under
#: ``TRITON_INTERPRET=1``). CPU tensors on a GPU machine are computed too, by each
#: function's padded PyTorch stage (the persistent LSTM: by the ``nn.LSTM`` it wraps).
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


class CachedLaunch:
    """A ``@triton.jit`` kernel launched as ``kernel[grid](*args, **kwargs)``, with the
    JIT's per-call work done once per specialisation (as a decorator, above ``@triton.jit``).

    Each launch through Triton's JIT binds the arguments, works out their
    specialisation (tensor dtypes, 16-byte aligned pointers, integers equal to 1 or
    divisible by 16), formats the options into a cache key and builds launch metadata:
    host time comparable to a small kernel's GPU time. Here the first launch of each
    specialisation goes through the JIT and keeps the compiled kernel it returns; later
    launches with the same key call that kernel's launcher directly. The key holds every
    fact the JIT specialises on, and more: the current device, the keyword arguments
    (constexprs and options) as given, each tensor's dtype and whether its address is a
    multiple of 16, and for each integer whether it is 1, whether it is a multiple of 16
    and which integer type holds it; so two launches with one key compile to the same
    kernel.

    The JIT takes the launch (and nothing is cached) for an interpreted kernel, when a
    launch hook is installed (profilers see what they expect), for a callable grid, and
    for argument types the key does not describe. Attribute access falls through to the
    kernel, so the object stands wherever the ``JITFunction`` did.
    """

    def __init__(self, kernel):
        self.kernel = kernel
        #: False where Triton chose the interpreter when the kernel was decorated (a
        #: later change of :data:`INTERPRETED` does not make it compiled code)
        self.compiles = type(kernel).__name__ == "JITFunction"
        self._compiled = {}

    def __getattr__(self, name):
        return getattr(self.kernel, name)

    def __getitem__(self, grid):
        return functools.partial(self._launch, grid)

    def _launch(self, grid, *args, **kwargs):
        if not self.compiles or callable(grid) or _launch_hooks_installed():
            return self.kernel[grid](*args, **kwargs)
        driver = _triton_driver().active
        device = driver.get_current_device()
        try:
            key = (device, tuple(kwargs.items()), *[_specialisation_of[type(a)](a) for a in args])
        except (KeyError, TypeError):  # an argument type or option value the key does not describe
            return self.kernel[grid](*args, **kwargs)
        entry = self._compiled.get(key)
        if entry is None:
            compiled = self.kernel[grid](*args, **kwargs)
            if type(compiled).__name__ == "CompiledKernel":
                names = self.kernel.arg_names
                if all(name in kwargs for name in names[len(args):]):
                    # the launcher takes every parameter in order, constexprs included
                    tail = tuple(kwargs[name] for name in names[len(args):])
                    self._compiled[key] = (compiled, compiled.run, compiled.function, compiled.packed_metadata, tail)
            return compiled
        compiled, run, function, metadata, tail = entry
        grid = (*grid, 1, 1)
        run(grid[0], grid[1], grid[2], driver.get_current_stream(device), function, metadata, None, None, None,
            *args, *tail)
        return compiled


@functools.lru_cache(maxsize=None)
def _triton_driver():
    """Triton's driver configuration (``.active``: the driver launches go through),
    imported once: an import statement costs every launch a module lookup."""
    from triton.runtime import driver

    return driver


@functools.lru_cache(maxsize=None)
def _runtime_knobs():
    """``triton.knobs.runtime``, which holds the launch hooks; ``None`` on a Triton
    release without ``knobs``."""
    import triton

    knobs = getattr(triton, "knobs", None)
    return None if knobs is None else knobs.runtime


def _launch_hooks_installed() -> bool:
    """Whether a Triton launch hook is set (Triton releases with ``triton.knobs`` keep
    them in chains, which are empty unless a hook was added)."""
    knobs = _runtime_knobs()
    if knobs is None:
        return True  # a release whose hooks live elsewhere: leave every launch to the JIT
    enter, leave = knobs.launch_enter_hook, knobs.launch_exit_hook
    return bool((enter is not None and getattr(enter, "calls", True))
                or (leave is not None and getattr(leave, "calls", True)))


def _integer_specialisation(value: int):
    return (value == 1, value % 16 == 0, -2 ** 31 <= value < 2 ** 31, value < 2 ** 63)


def _tensor_specialisation(value: torch.Tensor):
    return value.dtype, value.data_ptr() % 16 == 0


#: What the JIT specialises each argument type on (see :class:`CachedLaunch`).
_specialisation_of = {
    torch.Tensor: _tensor_specialisation,
    torch.nn.Parameter: _tensor_specialisation,
    int: _integer_specialisation,
    bool: lambda value: ("bool", value),
    float: lambda value: "float",
    type(None): lambda value: None,
}


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
    """Whether the kernels take ``tensor``: it lives on :data:`KERNEL_DEVICE`, or it has
    a shape and no values (a ``meta`` tensor, or a fake tensor outside ``torch.compile``,
    whose custom ops then give shapes by their fake implementations, where the padded
    stage's value-dependent shapes could not). A CPU tensor on a machine whose kernels are
    compiled for the GPU is not: the public functions compute it through their padded
    PyTorch stage instead (the persistent LSTM through the ``nn.LSTM`` it wraps)."""
    kind = tensor.device.type
    if kind == KERNEL_DEVICE or kind == "meta":
        return True
    return _is_fake(tensor) and not torch.compiler.is_compiling()


def _is_fake(tensor: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(tensor, FakeTensor)


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
