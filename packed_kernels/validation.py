"""Argument checks shared by every public function of the package.

The same mistake gives the same exception in every function:

* ``TypeError``: the wrong Python type (a list where a tensor is expected, a float
  where an int is), or the wrong dtype;
* ``ValueError``: the wrong shape, device, range or value.

Every message names the argument, what was expected and what came. The public
functions check shapes, dtypes and devices once, here, before any kernel launch.

**Values that live on the device** (segment ids, offsets, target ids and lengths) are
checked on the device, by the kernels that read them or by one beside them, and never
stop the host. Each such check is a :class:`ValueCheck` (registered once, with the
function and argument it names). A kernel that finds a violation stores the check's
code, and where it saw it, into one 64-bit *error word*: host memory that the GPU writes
directly (pinned and mapped), so that reading it costs the host no CUDA call and never
waits. The kernels stay memory-safe whatever the values (they clamp every index they
read), and a violation is reported as a ``ValueError`` naming the function and the
argument:

* **CPU tensors**: at once, before the call returns (the kernels have finished by then);
* **CUDA tensors, default**: by the first call into the package that finds the word
  written, at its start; at the latest by :func:`check_errors`, which waits for the GPU;
* **CUDA tensors, strict mode** (:func:`set_strict_checks`, :func:`strict_checks`, or
  ``PACKED_KERNELS_STRICT_CHECKS=1`` in the environment): at once, before the call
  returns, at the cost of one wait for the call's stream. A call captured into a CUDA
  graph is never waited for; its replays report as default calls do.
"""
from __future__ import annotations

import contextlib
import operator
import os
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
import triton
import triton.language as tl

from . import runtime


__all__ = [
    "FLOAT_DTYPES",
    "ValueCheck",
    "check_errors",
    "error_word",
    "raise_flags",
    "raise_reported",
    "report_flags",
    "report_violation",
    "set_strict_checks",
    "strict_checks",
    "value_check",
    "values_checked",
    "INDEX_DTYPES",
    "check_bool",
    "check_choice",
    "check_dtype",
    "check_float_tensor",
    "check_index_tensor",
    "check_rank",
    "check_same_device",
    "check_tensor",
    "integer_argument",
]

#: Floating dtypes the kernels read; float16 and bfloat16 are computed in float32.
FLOAT_DTYPES: Tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
#: Integer dtypes accepted for indices, offsets and lengths.
INDEX_DTYPES: Tuple[torch.dtype, ...] = (torch.int32, torch.int64)

_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32",
                torch.float64: "float64", torch.int32: "int32", torch.int64: "int64"}


def _dtype_list(dtypes: Sequence[torch.dtype]) -> str:
    names = [_DTYPE_NAMES.get(d, str(d)) for d in dtypes]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def integer_argument(name: str, value, what: str = "an int") -> int:
    """``value`` as a Python int: an ``int`` or an integer scalar such as ``numpy.int64``.

    ``bool`` and tensors are refused (a tensor would need a host synchronisation, and a
    bool is almost always a mistake); so is anything without ``__index__`` (floats).
    """
    if isinstance(value, (bool, torch.Tensor)) or not hasattr(type(value), "__index__"):
        raise TypeError(f"{name} must be {what}; got {type(value).__name__}")
    return operator.index(value)


def check_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool; got {type(value).__name__}")
    return value


def check_choice(name: str, value, choices: Iterable):
    choices = tuple(choices)
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}; got {value!r}")
    return value


def check_tensor(name: str, value) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(value).__name__}")
    return value


def check_rank(name: str, value: torch.Tensor, dims: Union[int, Sequence[int]], layout: Optional[str] = None) -> None:
    """``value.dim()`` must be ``dims`` (or one of them); ``layout`` names the axes."""
    dims = (dims,) if isinstance(dims, int) else tuple(dims)
    if value.dim() not in dims:
        wanted = " or ".join(f"{d}-D" for d in dims)
        if layout:
            wanted += f" {layout}"
        raise ValueError(f"{name} must be {wanted}; got shape {tuple(value.shape)}")


def check_dtype(name: str, value, dtypes: Sequence[torch.dtype], dims: Union[int, Sequence[int], None] = None,
                layout: Optional[str] = None) -> torch.Tensor:
    """A tensor of one of ``dtypes`` (``TypeError`` otherwise), of rank ``dims`` if given."""
    check_tensor(name, value)
    if value.dtype not in dtypes:
        raise TypeError(f"{name} must be {_dtype_list(dtypes)}; got {value.dtype}")
    if dims is not None:
        check_rank(name, value, dims, layout)
    return value


def check_float_tensor(name: str, value, dims: Union[int, Sequence[int], None] = None,
                       dtypes: Sequence[torch.dtype] = FLOAT_DTYPES, layout: Optional[str] = None) -> torch.Tensor:
    """A tensor of one of ``dtypes`` (default: the floating dtypes the kernels read)."""
    return check_dtype(name, value, dtypes, dims, layout)


def check_index_tensor(name: str, value, dims: Union[int, Sequence[int], None] = None,
                       layout: Optional[str] = None) -> torch.Tensor:
    """An integer tensor (int32 or int64) of offsets, lengths or ids."""
    return check_dtype(name, value, INDEX_DTYPES, dims, layout)


def check_same_device(**tensors: torch.Tensor) -> None:
    """Every tensor on the device of the first one named."""
    items = list(tensors.items())
    first_name, first = items[0]
    for name, tensor in items[1:]:
        if tensor.device != first.device:
            raise ValueError(f"{name} must be on {first_name}'s device ({first.device}); got {tensor.device}")


# --- values checked on the device ---------------------------------------------------------

#: Bits of the error word that hold the position of a violation; the check's code sits above.
POSITION_BITS = 40
_POSITION_LIMIT = (1 << POSITION_BITS) - 1
_POSITION_BITS_IN_KERNELS = tl.constexpr(POSITION_BITS)
_POSITION_LIMIT_IN_KERNELS = tl.constexpr(_POSITION_LIMIT)


class ValueCheck:
    """A check of values that kernels make on the device: ``function``'s ``argument``
    must meet ``requirement``; ``code`` is what a kernel stores in the error word (with the
    position of the entry that fails, called ``position``: ``"row"``, ``"utterance"``, ...)."""

    def __init__(self, code: int, function: str, argument: str, requirement: str, position: str):
        self.code, self.function, self.argument = code, function, argument
        self.requirement, self.position = requirement, position

    def error(self, where: int) -> ValueError:
        """The exception for a violation found at position ``where``."""
        return ValueError(f"{self.function}: {self.argument} {self.requirement}, which fails at {self.position} {where}")

    def __repr__(self):
        return f"ValueCheck({self.code}, {self.function}: {self.argument} {self.requirement})"


_CHECKS: List[Optional[ValueCheck]] = [None]  # code 0: no violation
_CHECK_CODES: Dict[Tuple[str, str, str], ValueCheck] = {}


def value_check(function: str, argument: str, requirement: str, position: str = "row") -> ValueCheck:
    """The :class:`ValueCheck` of ``function``'s ``argument`` and ``requirement`` (one code
    per distinct triple, made on first use)."""
    key = (function, argument, requirement)
    check = _CHECK_CODES.get(key)
    if check is None:
        check = ValueCheck(len(_CHECKS), function, argument, requirement, position)
        _CHECKS.append(check)
        _CHECK_CODES[key] = check
    return check


class _ErrorWord:
    """One int64 word per kind of device: ``tensor`` is what kernels get as a pointer,
    ``view`` the host's numpy view of the same memory."""

    def __init__(self, pinned: bool):
        self.tensor = torch.zeros((1,), dtype=torch.int64, pin_memory=pinned)
        self.view = self.tensor.numpy()


_WORDS: Dict[str, _ErrorWord] = {}


def error_word(device: torch.device) -> torch.Tensor:
    """The error word that kernels on ``device`` write violations into: for a CUDA device
    a pinned host tensor, which every GPU writes directly (CUDA's unified addressing maps
    pinned memory into the device address space), for the CPU a plain tensor."""
    kind = "cuda" if device.type == "cuda" else "cpu"
    word = _WORDS.get(kind)
    if word is None:
        word = _WORDS[kind] = _ErrorWord(pinned=kind == "cuda")
    return word.tensor


def _decode(value: int) -> ValueError:
    code, where = value >> POSITION_BITS, value & _POSITION_LIMIT
    check = _CHECKS[code] if 0 < code < len(_CHECKS) else None
    if check is None:
        return ValueError(f"a kernel reported an unknown violation (word {value:#x})")
    return check.error(where)


def raise_reported() -> None:
    """Raise the violation that the kernels of earlier calls reported, if any has arrived
    (and forget it). Reads host memory only: it never waits for the GPU. Nothing while
    ``torch.compile`` traces (the compiled call's kernels report to the next eager one)."""
    if torch.compiler.is_compiling():
        return
    for word in _WORDS.values():
        value = int(word.view[0])
        if value:
            word.view[0] = 0
            raise _decode(value)


_STRICT = [os.environ.get("PACKED_KERNELS_STRICT_CHECKS", "0") not in ("", "0")]


def set_strict_checks(enabled: bool) -> bool:
    """Switch strict mode on or off for the whole process; returns the previous setting.

    In strict mode, an eager call on CUDA tensors waits for its own stream once its kernels
    are queued, and raises a violation of its values before it returns, as a call on CPU
    tensors always does. That wait is a synchronisation: use it to find which call gets
    bad values, not in a model's hot path.

    Example:
        >>> import packed_kernels as pk
        >>> previous = pk.set_strict_checks(True)  # from here on, CUDA calls raise within the call
        >>> pk.set_strict_checks(previous)  # back to the earlier setting; returns the replaced one
        True
    """
    previous = _STRICT[0]
    _STRICT[0] = check_bool("enabled", enabled)
    return previous


@contextlib.contextmanager
def strict_checks(enabled: bool = True):
    """Strict mode (:func:`set_strict_checks`) inside a ``with`` block; the earlier setting
    comes back when the block ends, even through an exception.

    Example:
        >>> import torch
        >>> import packed_kernels as pk
        >>> with pk.strict_checks():  # unsorted idx: raised within the call on any device
        ...     pk.segmented_sum(torch.ones(3), torch.tensor([0, 2, 1]), 3)
        Traceback (most recent call last):
          ...
        ValueError: segmented_sum: idx must be sorted in non-decreasing order, which fails at row 2
    """
    previous = set_strict_checks(enabled)
    try:
        yield
    finally:
        set_strict_checks(previous)


def values_checked(device: torch.device) -> None:
    """What a public function calls once the kernels that check its values are queued on
    ``device``: on the CPU (where they have finished) and in strict mode (after a wait for
    the current stream) it raises their violation now; otherwise it returns at once and
    a later call reports it."""
    if device.type == "cuda":
        if not _STRICT[0] or torch.cuda.is_current_stream_capturing():
            return
        torch.cuda.current_stream(device).synchronize()
    raise_reported()


def check_errors() -> None:
    """Wait for every GPU, then raise the violation of values that any earlier call's
    kernels reported (``ValueError`` naming the function and the argument), if any.

    The default mode reports a violation at the start of a later call; call this where a
    program must know that everything so far had valid values (at the end of a step, a
    test, a data-loading check). Returns ``None`` when nothing was reported.

    Example:
        >>> import torch
        >>> import packed_kernels as pk
        >>> total = pk.segmented_sum(torch.ones(4), torch.tensor([0, 0, 1, 1]), 2)
        >>> pk.check_errors()  # waits for any GPU work: raises if an earlier call got a bad idx
        >>> total
        tensor([2., 2.])
    """
    if "cuda" in _WORDS and torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            torch.cuda.synchronize(index)
    raise_reported()


@triton.jit
def report_violation(word_ptr, code, bad, position):
    """Store ``code`` and the smallest ``position`` where ``bad`` holds into the error word
    (one 64-bit store, so concurrent reports never mix; nothing where ``bad`` is all
    false). ``bad`` and ``position`` are 1-D blocks of one shape; ``code`` a scalar."""
    limit: tl.constexpr = _POSITION_LIMIT_IN_KERNELS
    where = tl.min(tl.where(bad, tl.minimum(position.to(tl.int64), limit), limit + 1))
    if where <= limit:
        # (code may be a constexpr: the JIT specialises an integer argument equal to 1)
        tl.store(word_ptr, ((tl.zeros((), tl.int64) + code) << _POSITION_BITS_IN_KERNELS) | where)


@runtime.CachedLaunch
@triton.jit
def _report_flags_kernel(flags_ptr, n, word_ptr, code, BLOCK: tl.constexpr):
    positions = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    bad = tl.load(flags_ptr + positions, mask=positions < n, other=0) != 0
    report_violation(word_ptr, code, bad, positions)


def report_flags(check: ValueCheck, flags: torch.Tensor) -> None:
    """Report ``check`` at the first position where the 1-D ``flags`` (bool or integer, on
    the device, computed by PyTorch ops) are set; nothing if none is. For checks whose
    values PyTorch ops already hold; one small launch, no host read."""
    n = flags.numel()
    if n == 0:
        return
    flags = flags.reshape(n)
    if flags.dtype == torch.bool:
        flags = flags.view(torch.uint8)
    block = min(1024, runtime.next_power_of_2(n))
    _report_flags_kernel[(runtime.cdiv(n, block),)](flags, n, error_word(flags.device), check.code, BLOCK=block)


def raise_flags(check: ValueCheck, flags: torch.Tensor, offset: int = 0) -> None:
    """The host's twin of :func:`report_flags`, for CPU tensors (which cost nothing to
    read): raise ``check`` at once, at ``offset`` plus the first position where the 1-D
    ``flags`` are set; nothing if none is."""
    failing = flags.reshape(-1).nonzero()
    if failing.numel():
        raise check.error(offset + int(failing[0, 0]))
