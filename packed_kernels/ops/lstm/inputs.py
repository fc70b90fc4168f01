"""The forms of input :class:`~packed_kernels.ops.lstm.PersistentLSTM` takes, as the kernels read them.

A call's input is a padded tensor (``(B, T, I)`` or ``(T, B, I)`` by the module's
``batch_first``, with optional ``lengths``), an unbatched ``(T, I)`` sequence, a
:class:`~packed_kernels.Packed` batch or a ``torch.nn.utils.rnn.PackedSequence``.
:func:`adapt_input` checks it (types, dtypes, shapes and devices on the host, at once;
the values of lengths and offsets on the device) and gives one :class:`LSTMInput`: the
rows as the kernels read them, the way back to the caller's form, and the arguments the
wrapped ``nn.LSTM`` gets where the kernels do not apply.

Every form is the same thing to the kernels (:class:`KernelInput`): rows of ``I``
features in which frame ``t`` of sequence ``b`` is row ``row_start[b] + t row_step``,
for ``t < lengths[b]``:

* batch first, ``(B, T, I)`` (and unbatched, ``B = 1``): row ``b T + t``, so
  ``row_start[b] = b T`` and ``row_step = 1``;
* time major, ``(T, B, I)``: row ``t B + b``, so ``row_start[b] = b`` and ``row_step = B``;
* a ``Packed`` batch: ``row_start = cu_seqlens[:-1]`` and ``row_step = 1``;
* a ``PackedSequence``, whose rows are interleaved by time: its rows reordered into a
  ``Packed`` batch's order, and the output's rows back into its own.

The output has the input's rows, ``D H`` features each, so the way back is a view (a
gather for a ``PackedSequence``).
"""
from __future__ import annotations

from typing import Callable, List, NamedTuple, Optional, Tuple

import torch
from torch import Tensor
from torch.nn.utils.rnn import PackedSequence

from ... import dispatch, runtime, validation
from ...dispatch import TRACED
from ...packing import Packed, pack, unpack
from .module_view import ModuleView
from .padded_torch import lstm_padded, lstm_weights

__all__ = ["KernelInput", "LSTMInput", "adapt_input", "lstm_checked_lengths_op", "lstm_checked_packed_op"]

State = Tuple[Tensor, Tensor]

#: ``run_module(input, hx)``: the wrapped ``nn.LSTM`` on exactly these arguments.
RunModule = Callable[..., Tuple[object, State]]

#: The dtypes ``nn.LSTM`` takes for float32 parameters under autocast.
AUTOCAST_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# -- values checked on the device ----------------------------------------------------

_LENGTHS_IN_RANGE = validation.value_check(
    "PersistentLSTM", "lengths", "must lie in [0, T] (T: the input's time steps)", "sequence")
_PACKED_LENGTHS_NONNEGATIVE = validation.value_check("PersistentLSTM", "packed.lengths", "must be >= 0", "sequence")
_PACKED_OFFSETS = validation.value_check(
    "PersistentLSTM", "packed.cu_seqlens", "must be [0, cumsum(packed.lengths)] (a Packed from pack())", "entry")
# fails at the first sequence whose end passes the rows of packed.data, or at the last one
# where the lengths sum to fewer rows
_PACKED_ROWS = validation.value_check("PersistentLSTM", "packed.lengths", "must sum to the rows of packed.data",
                                      "sequence")

#: report_flags on the GPU of its flags (Triton launches on the current device).
_report_flags = runtime.on_inputs_device(validation.report_flags)


def _lengths_violations(lengths: Tensor, steps: int) -> List[Tuple[validation.ValueCheck, Tensor]]:
    """The ``(check, flags)`` of a padded call's ``lengths`` (int64 ``(B,)``)."""
    return [(_LENGTHS_IN_RANGE, (lengths < 0) | (lengths > steps))]


def _packed_violations(cu_seqlens: Tensor, lengths: Tensor, rows: int) -> List[Tuple[validation.ValueCheck, Tensor]]:
    """The ``(check, flags)`` of a :class:`Packed` batch's offsets and lengths (int64,
    ``(B + 1,)`` and ``(B,)``, ``B >= 1`` or ``rows == 0``) for ``rows`` rows of data, the
    check to name first where several fail first."""
    ends = torch.cumsum(lengths, 0)
    past = ends > rows
    past[-1:] |= ends[-1:] != rows
    offsets = torch.cat([cu_seqlens[:1] != 0, cu_seqlens[1:] != ends])
    return [(_PACKED_LENGTHS_NONNEGATIVE, lengths < 0), (_PACKED_OFFSETS, offsets), (_PACKED_ROWS, past)]


def _report(violations: List[Tuple[validation.ValueCheck, Tensor]], on_host: bool) -> None:
    """Report ``violations`` (:func:`_lengths_violations`, :func:`_packed_violations`):
    ``on_host``, raise the first that fails at once (host tensors, which cost nothing to
    read); else into the error word, without a host read. A report overwrites the word,
    so the first check is reported last: where several fail, it is the one raised."""
    if on_host:
        for check, flags in violations:
            validation.raise_flags(check, flags)
    else:
        for check, flags in reversed(violations):
            _report_flags(check, flags)


@dispatch.operator("lstm_checked_lengths")
def lstm_checked_lengths_op(lengths: Tensor, steps: int) -> Tensor:
    """A padded call's ``lengths`` (int64 ``(B,)``) as the kernels read them: clamped to
    ``[0, steps]``, so that every frame they reach lies in the input, and checked on the
    device (a violation reported into the error word)."""
    _report(_lengths_violations(lengths, steps), on_host=False)
    return lengths.clamp(0, steps)


@lstm_checked_lengths_op.register_fake
def _(lengths, steps):
    return torch.empty_like(lengths)


@dispatch.operator("lstm_checked_packed")
def lstm_checked_packed_op(cu_seqlens: Tensor, lengths: Tensor, rows: int) -> tuple[Tensor, Tensor]:
    """A :class:`Packed` batch's ``(row_start, lengths)`` (int64 ``(B,)``) as the kernels
    read them, for ``rows`` rows of data: each start clamped to ``[0, rows]`` and each
    length to ``[0, rows - start]``, so that every row they reach lies in the data, and
    ``cu_seqlens`` and ``lengths`` checked on the device (a violation reported into the
    error word). Equal to ``(cu_seqlens[:-1], lengths)`` where those are valid."""
    cu_seqlens, lengths = cu_seqlens.to(torch.int64), lengths.to(torch.int64)
    _report(_packed_violations(cu_seqlens, lengths, rows), on_host=False)
    return _clamped_rows(cu_seqlens, lengths, rows)


@lstm_checked_packed_op.register_fake
def _(cu_seqlens, lengths, rows):
    return lengths.new_empty(lengths.shape, dtype=torch.int64), lengths.new_empty(lengths.shape, dtype=torch.int64)


def _clamped_rows(cu_seqlens: Tensor, lengths: Tensor, rows: int) -> Tuple[Tensor, Tensor]:
    start = cu_seqlens[:-1].clamp(0, rows)
    return start, torch.minimum(lengths.clamp(min=0), rows - start)


# -- the input, as the kernels read it and as the caller gets it back ---------------------

class KernelInput(NamedTuple):
    """A batch as the kernels read it: frame ``t`` of sequence ``b`` is row
    ``row_start[b] + t row_step`` of ``rows`` for ``t < lengths[b]``, and the output has
    one row of ``D H`` features per row of ``rows``.

    ``rows`` ``(N, I)``; ``row_start`` int64 and ``lengths`` int32, ``(batch,)``, every
    frame they reach inside ``rows`` whatever the caller's values; ``zero_fill``: rows
    that are no frame of any sequence (padding) are zero in the output; ``sort``: the
    lengths may differ, so the sequences are sorted by length before the launch.
    """

    rows: Tensor
    row_start: Tensor
    row_step: int
    lengths: Tensor
    batch: int
    zero_fill: bool
    sort: bool


class LSTMInput:
    """One call's input, checked (built by :func:`adapt_input`).

    Attributes:
        module: the :class:`~.module_view.ModuleView` of the wrapped ``nn.LSTM``.
        mode: the call's :func:`~packed_kernels.dispatch.call_mode`, decided once from
            the input's tensors.
        data: the input's frames, whose device, dtype and ``requires_grad`` decide
            between the kernels and the wrapped ``nn.LSTM``.
        state: ``(h0, c0)``, ``(num_layers D, B, H)`` each (an unbatched one given a
            batch of 1), or ``None``.
        batch: ``B``.
        checked_on_device: whether a value check of the device reported into the error
            word (:func:`~packed_kernels.validation.values_checked` then collects it).
    """

    def __init__(self, module: ModuleView, mode: str, data: Tensor, state: Optional[State], batch: int,
                 checked_on_device: bool):
        self.module, self.mode, self.data, self.state = module, mode, data, state
        self.batch, self.checked_on_device = batch, checked_on_device

    def kernel_input(self) -> KernelInput:
        """The rows as the kernels read them."""
        raise NotImplementedError

    def output(self, y: Tensor, state: State):
        """``(output, (h_n, c_n))`` in the caller's form, from the kernels' output rows
        ``y`` (one per row of :meth:`kernel_input`'s) and final state."""
        raise NotImplementedError

    def module_output(self, run_module: RunModule):
        """``(output, (h_n, c_n))`` in the caller's form, by the wrapped ``nn.LSTM``
        (``run_module(input, hx)``) on the arguments ``nn.LSTM`` would get: the input
        itself, or a ``PackedSequence`` for a ``Packed`` batch or ``lengths``."""
        raise NotImplementedError


def adapt_input(input, hx: Optional[State], lengths, module: ModuleView) -> LSTMInput:
    """Check a call's arguments (``forward``'s) and adapt them: a :class:`PaddedInput`,
    :class:`PackedInput` or :class:`SequenceInput`. Types, dtypes, shapes and devices are
    checked here, at once; the values of lengths and offsets on the device (where the
    kernels run; on the host, at once, elsewhere)."""
    if isinstance(input, PackedSequence):
        if lengths is not None:
            raise ValueError("lengths must not be given with a PackedSequence input: it carries its own")
        return SequenceInput(input, hx, module)
    if isinstance(input, Packed):
        if lengths is not None:
            raise ValueError("lengths must not be given with a Packed input: it carries its own")
        return PackedInput(input, hx, module)
    if not isinstance(input, torch.Tensor):
        raise TypeError("input must be a torch.Tensor, a packed_kernels.Packed or a PackedSequence; "
                        f"got {type(input).__name__}")
    return PaddedInput(input, hx, lengths, module)


class PaddedInput(LSTMInput):
    """A padded tensor, ``(B, T, I)`` or ``(T, B, I)`` by the module's ``batch_first``,
    or ``(T, I)`` unbatched, with optional ``lengths`` (int ``(B,)``, each in ``[0, T]``)."""

    def __init__(self, input: Tensor, hx, lengths, module: ModuleView):
        batch_first = module.batch_first
        validation.check_rank("input", input, (3, 2),
                              f"{'(B, T, I)' if batch_first else '(T, B, I)'} or (T, I) unbatched")
        unbatched = input.dim() == 2
        x = input.unsqueeze(0) if unbatched else (input if batch_first else input.transpose(0, 1))
        batch, steps = x.shape[0], x.shape[1]
        _check_data("input", x, module)
        state = _check_state(hx, batch, "input", x, unbatched, module)
        mode = dispatch.call_mode(x, lengths)
        checked_on_device = False
        if lengths is not None:
            if unbatched:
                raise ValueError("lengths needs a batched input")
            lengths, checked_on_device = _check_lengths(lengths, batch, steps, x.device, mode)
        super().__init__(module, mode, x, state, batch, checked_on_device)
        self.input, self.hx, self.steps, self.lengths = input, hx, steps, lengths
        self.x = x  # the input batch first (a view)
        self.unbatched, self.time_major = unbatched, not (batch_first or unbatched)

    def kernel_input(self) -> KernelInput:
        batch, steps, device = self.batch, self.steps, self.x.device
        rows = (self.input if self.time_major else self.x).reshape(batch * steps, self.x.shape[2])
        if self.lengths is None:
            lengths = torch.full((batch,), steps, dtype=torch.int32, device=device)
        else:
            lengths = self.lengths.to(torch.int32)
        sequence = torch.arange(batch, dtype=torch.int64, device=device)
        if self.time_major:
            row_start, row_step = sequence, batch
        else:
            row_start, row_step = sequence * steps, 1
        uneven = self.lengths is not None
        return KernelInput(rows, row_start, row_step, lengths, batch, zero_fill=uneven, sort=uneven)

    def output(self, y: Tensor, state: State):
        features = y.shape[1]
        y = y.view(self.steps, self.batch, features) if self.time_major else y.view(self.batch, self.steps, features)
        if self.unbatched:
            return y[0], (state[0][:, 0], state[1][:, 0])
        return y, state

    def module_output(self, run_module: RunModule):
        if self.lengths is None:
            return run_module(self.input, None if self.hx is None else tuple(self.hx))
        module = self.module
        if self.mode is TRACED:
            # a PackedSequence needs its lengths on the host: the padded PyTorch stage instead
            if module.training and module.dropout > 0 and module.num_layers > 1:
                raise ValueError("a traced call with lengths runs the padded PyTorch stage, which has no "
                                 f"dropout; the nn.LSTM has dropout={module.dropout}: call .eval() first")
            y, state = lstm_padded(self.x, lstm_weights(module), self.lengths, *(self.state or (None, None)))
        else:
            out, state = _module_on_packed(run_module, pack(self.x, self.lengths), self.state, module, self.mode)
            y = unpack(out, total_length=self.steps)
        return (y if module.batch_first else y.transpose(0, 1)), state


class PackedInput(LSTMInput):
    """A :class:`~packed_kernels.Packed` batch: ``data`` ``(N, I)``, ``cu_seqlens``
    ``(B + 1,)``, ``lengths`` ``(B,)``."""

    def __init__(self, packed: Packed, hx, module: ModuleView):
        data, cu_seqlens, lengths = packed.data, packed.cu_seqlens, packed.lengths
        validation.check_index_tensor("packed.lengths", lengths, 1, "(B,)")
        validation.check_index_tensor("packed.cu_seqlens", cu_seqlens, 1, "(B + 1,)")
        batch = lengths.numel()
        if cu_seqlens.shape != (batch + 1,):
            raise ValueError(f"packed.cu_seqlens must have shape (B + 1,) = ({batch + 1},) for the B = {batch} "
                             f"packed.lengths; got {tuple(cu_seqlens.shape)}")
        validation.check_tensor("packed.data", data)
        validation.check_rank("packed.data", data, 2, "(N, input_size)")
        _check_data("packed.data", data, module)
        validation.check_same_device(**{"packed.data": data, "packed.cu_seqlens": cu_seqlens,
                                        "packed.lengths": lengths})
        rows = data.shape[0]
        if batch == 0 and rows:
            raise ValueError(f"packed.data has {rows} rows but packed.lengths is empty (no sequence to hold them)")
        mode = dispatch.call_mode(data, cu_seqlens, lengths)
        state = _check_state(hx, batch, "packed.data", data, False, module)
        checked_on_device = runtime.on_kernel_device(data)
        self.row_start = self.checked_lengths = None
        if checked_on_device:
            self.row_start, self.checked_lengths = lstm_checked_packed_op.run(mode, cu_seqlens, lengths, rows)
        elif mode is not TRACED:
            _report(_packed_violations(cu_seqlens.to(torch.int64), lengths.to(torch.int64), rows), on_host=True)
        super().__init__(module, mode, data, state, batch, checked_on_device)
        self.packed = packed

    def kernel_input(self) -> KernelInput:
        return KernelInput(self.data, self.row_start, 1, self.checked_lengths.to(torch.int32), self.batch,
                           zero_fill=False, sort=True)

    def output(self, y: Tensor, state: State):
        return Packed(y, self.packed.cu_seqlens, self.packed.lengths), state

    def module_output(self, run_module: RunModule):
        if self.row_start is not None:
            # nn.LSTM reads the rows the kernels would: in the data whatever the values
            rows = self.data.shape[0]
            starts = torch.cat([self.row_start, self.row_start.new_full((1,), rows)])
            checked = Packed(self.data, starts, self.checked_lengths)
        else:
            checked = self.packed
        out, state = _module_on_packed(run_module, checked, self.state, self.module, self.mode)
        return Packed(out.data, self.packed.cu_seqlens, self.packed.lengths), state


class SequenceInput(LSTMInput):
    """A ``torch.nn.utils.rnn.PackedSequence``: ``data`` ``(N, I)``, rows interleaved by
    time step as ``batch_sizes`` (on the host) says, in ``sorted_indices`` order."""

    def __init__(self, sequence: PackedSequence, hx, module: ModuleView):
        data = sequence.data
        validation.check_rank("input.data", data, 2, "(N, input_size)")
        _check_data("input.data", data, module)
        batch = _sequence_count(sequence)
        state = _check_state(hx, batch, "input.data", data, False, module)
        super().__init__(module, dispatch.call_mode(data), data, state, batch, False)
        self.sequence, self.hx = sequence, hx
        #: the row of the Packed order that each of the sequence's rows holds (by kernel_input)
        self.packed_rows: Optional[Tensor] = None

    def kernel_input(self) -> KernelInput:
        data, sequence = self.data, self.sequence
        self.packed_rows, lengths = _packed_rows(sequence, self.mode)
        row_start = torch.cumsum(lengths, 0) - lengths
        rows = data.new_empty(data.shape).index_copy_(0, self.packed_rows, data)
        return KernelInput(rows, row_start, 1, lengths.to(torch.int32), self.batch, zero_fill=False, sort=True)

    def output(self, y: Tensor, state: State):
        sequence = self.sequence
        return PackedSequence(y[self.packed_rows], sequence.batch_sizes, sequence.sorted_indices,
                              sequence.unsorted_indices), state

    def module_output(self, run_module: RunModule):
        return run_module(self.sequence, None if self.hx is None else tuple(self.hx))


# -- the checks on the host ----------------------------------------------------------

def _check_data(name: str, x: Tensor, module: ModuleView) -> None:
    first = module.weight_ih_l0
    # outside autocast, the parameters' dtype (checked to be one of PARAMETER_DTYPES)
    dtypes = AUTOCAST_DTYPES if runtime.autocast_enabled(x.device.type) else (first.dtype,)
    validation.check_float_tensor(name, x, dtypes=dtypes)
    if x.shape[-1] != module.input_size:
        raise ValueError(
            f"{name} must have {module.input_size} features (the nn.LSTM's input_size) in its last "
            f"dimension; got shape {tuple(x.shape)}"
        )
    if x.device != first.device:
        raise ValueError(f"{name} must be on the device of the nn.LSTM's parameters ({first.device}); "
                         f"got {x.device}")


def _check_state(hx, batch: int, x_name: str, x: Tensor, unbatched: bool, module: ModuleView) -> Optional[State]:
    """``hx`` checked, an unbatched one given a batch of 1; ``None`` stays ``None``."""
    if hx is None:
        return None
    if not isinstance(hx, (tuple, list)) or len(hx) != 2:
        raise TypeError(f"hx must be a tuple (h0, c0), as for nn.LSTM; got {type(hx).__name__}")
    num_states = module.num_layers * (2 if module.bidirectional else 1)
    expected = (num_states, module.hidden_size) if unbatched else (num_states, batch, module.hidden_size)
    dtypes = AUTOCAST_DTYPES if runtime.autocast_enabled(x.device.type) else (module.weight_hh_l0.dtype,)
    checked = []
    for name, t in zip(("h0", "c0"), hx):
        validation.check_float_tensor(name, t, dtypes=dtypes)
        if tuple(t.shape) != expected:
            raise ValueError(f"{name} must have shape {expected}; got {tuple(t.shape)}")
        validation.check_same_device(**{x_name: x, name: t})
        checked.append(t.unsqueeze(1) if unbatched else t)
    return tuple(checked)


def _check_lengths(lengths, batch: int, steps: int, device: torch.device, mode: str) -> Tuple[Tensor, bool]:
    """A padded call's ``lengths`` as int64 on ``device``, as the kernels read them, and
    whether their values were checked on the device (:func:`lstm_checked_lengths_op`,
    which clamps them to ``[0, steps]``; the caller then calls
    :func:`~packed_kernels.validation.values_checked`). Lengths off the kernel device are
    checked on the host, at once. The type and shape are checked at once."""
    if not isinstance(lengths, torch.Tensor):
        lengths = torch.as_tensor(lengths)  # a list or an array of ints
    validation.check_index_tensor("lengths", lengths)
    if lengths.shape != (batch,):
        raise ValueError(f"lengths must have shape ({batch},) (one per sequence); got {tuple(lengths.shape)}")
    lengths = _on_device(lengths.to(torch.int64), device, mode)
    if runtime.on_kernel_device(lengths):
        return lstm_checked_lengths_op.run(mode, lengths, steps), True
    if mode is not TRACED:
        _report(_lengths_violations(lengths, steps), on_host=True)
    return lengths, False


def _on_device(t: Tensor, device: torch.device, mode: str) -> Tensor:
    """``t`` on ``device``. A host tensor goes to a GPU through pinned memory, without a
    wait: a copy from pageable memory waits for the work queued on the GPU."""
    if t.device.type == "cpu" and device.type == "cuda" and mode is not TRACED:
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


# -- PackedSequence and Packed layouts, for the kernels and for nn.LSTM -------------------

def _sequence_count(sequence: PackedSequence) -> int:
    """The number of sequences of ``sequence``: one sorted index each, or (without
    ``sorted_indices``) the size of the first time step, read from ``batch_sizes`` on the
    host (a ``PackedSequence`` holds no empty sequence)."""
    if sequence.sorted_indices is not None:
        return sequence.sorted_indices.shape[0]
    batch_sizes = sequence.batch_sizes
    return int(batch_sizes[0]) if batch_sizes.numel() else 0


def _packed_rows(sequence: PackedSequence, mode: str) -> Tuple[Tensor, Tensor]:
    """For the layout of ``sequence`` (``batch_sizes``, ``sorted_indices``): the row of a
    :class:`Packed` batch of the same sequences (in their original order) that each of
    its rows holds, and the length of each sequence (int64), both on the device of its
    data.

    Row ``r`` of the ``PackedSequence`` is time step ``t`` of the sequence of rank ``k``
    (``k``-th longest), ``sorted_indices[k]``; ties in length are in whatever order
    ``sorted_indices`` says. What depends on ``batch_sizes`` alone is computed on the host,
    where a ``PackedSequence`` keeps it, and goes to the device in one copy; the rest is
    computed there. The sizes are the tensors' shapes (the rows of ``data``, the entries
    of ``sorted_indices``), which a traced call knows without reading a value. A sequence
    that ``sorted_indices`` names no rank of has length 0, so the lengths never sum to
    more than the rows.
    """
    device, total, batch = sequence.data.device, sequence.data.shape[0], _sequence_count(sequence)
    batch_sizes = sequence.batch_sizes.to(torch.int64)
    sorted_lengths = (batch_sizes[None, :] > torch.arange(batch)[:, None]).sum(1)
    step_starts = torch.cumsum(batch_sizes, 0) - batch_sizes  # the first row of each time step
    on_device = _on_device(torch.cat([sorted_lengths, step_starts]), device, mode)
    sorted_lengths, step_starts = on_device[:batch], on_device[batch:]
    row = torch.arange(total, device=device)
    step_of_row = torch.searchsorted(step_starts, row, right=True) - 1
    rank_of_row = row - step_starts[step_of_row]
    sorted_indices = sequence.sorted_indices
    if sorted_indices is None:
        sorted_indices = torch.arange(batch, device=device)
    lengths = torch.zeros(batch, dtype=torch.int64, device=device).index_copy_(0, sorted_indices, sorted_lengths)
    starts = torch.cumsum(lengths, 0) - lengths
    rows = starts[sorted_indices[rank_of_row]] + step_of_row
    return rows, lengths


def _packed_data(sequence: PackedSequence, mode: str) -> Tensor:
    """The rows of ``sequence`` in the order of a :class:`Packed` batch (sequence after
    sequence, in their original order); differentiable."""
    data = sequence.data
    rows, _ = _packed_rows(sequence, mode)
    return data.new_empty(data.shape).index_copy(0, rows, data)


def _module_on_packed(run_module: RunModule, packed: Packed, hx: Optional[State], module: ModuleView,
                      mode: str) -> Tuple[Packed, State]:
    """The wrapped ``nn.LSTM`` (``run_module``) on the ``PackedSequence`` of ``packed``. A
    ``PackedSequence`` holds no empty sequence: those are left out of the call, have no
    output rows, and keep their initial state."""
    lengths = packed.lengths
    num_directions = 2 if module.bidirectional else 1
    nonempty = torch.nonzero(lengths > 0).flatten()
    if nonempty.numel() == lengths.numel() and lengths.numel():
        out, state = run_module(packed.to_packed_sequence(), hx)
        return Packed(_packed_data(out, mode), packed.cu_seqlens, lengths), state
    if hx is None:
        shape = (module.num_layers * num_directions, lengths.numel(), module.hidden_size)
        hx = (packed.data.new_zeros(shape), packed.data.new_zeros(shape))
    if nonempty.numel() == 0:  # nothing for nn.LSTM to run
        y = packed.data.new_empty((0, num_directions * module.hidden_size))
        return Packed(y, packed.cu_seqlens, lengths), (hx[0].clone(), hx[1].clone())
    kept_lengths = lengths[nonempty]
    # the kept sequences' own starts (the cumulative sums of their lengths where the
    # offsets are valid; inside the data where they were clamped)
    kept = Packed(packed.data, torch.cat([packed.cu_seqlens[:-1][nonempty], packed.cu_seqlens[-1:]]), kept_lengths)
    out, (h_kept, c_kept) = run_module(kept.to_packed_sequence(), (hx[0][:, nonempty], hx[1][:, nonempty]))
    h_n = hx[0].to(h_kept.dtype).index_copy(1, nonempty, h_kept)
    c_n = hx[1].to(c_kept.dtype).index_copy(1, nonempty, c_kept)
    return Packed(_packed_data(out, mode), packed.cu_seqlens, lengths), (h_n, c_n)
