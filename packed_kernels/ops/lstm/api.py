"""``PersistentLSTM``: an ``nn.LSTM`` run by one persistent Triton launch per layer.

The kernels compute inference only. A call that needs what they do not give (a
gradient, autocast, a tensor off the kernel device) runs the wrapped ``nn.LSTM``
itself. A traced call (:func:`~packed_kernels.dispatch.is_traced`) runs each layer's
recurrence as the custom op ``packed_kernels::lstm_recurrence``, which has no gradient
formula; an eager call launches the kernels directly.

A call on tensors of the kernel device reads no value on the host: shapes, dtypes and
devices are checked at once, the values of lengths and offsets on the device (the
policy of :mod:`~packed_kernels.validation`), and the kernels read them clamped so that
no value can make them read or write out of bounds.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import warnings
from typing import List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor
from torch.nn.utils.rnn import PackedSequence

from ... import dispatch, runtime, validation
from ...packing import Packed, pack, unpack
from .padded_torch import DirectionWeights, lstm_padded, lstm_weights
from .triton_kernels import (
    MAX_HIDDEN,
    RecurrenceConfig,
    RecurrentProduct,
    StepWait,
    choose_config,
    input_projection_triton,
    lstm_recurrence_triton,
)

__all__ = ["PersistentLSTM"]

State = Tuple[torch.Tensor, torch.Tensor]


#: Input widths from which a layer's input projection runs as three TF32 products on
#: tensor cores (:func:`input_projection_triton`) rather than cuBLAS's float32 product,
#: which does not use them; narrower rows defeat the kernel's wide loads.
TENSOR_CORE_PROJECTION_MIN_K = 128

#: The dtypes ``nn.LSTM`` takes for float32 parameters under autocast.
AUTOCAST_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

#: The parameter dtypes the kernels run (all parameters of a module in one of them).
PARAMETER_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

_CONFIG_FIELDS = tuple(field.name for field in dataclasses.fields(RecurrenceConfig))


def _config_as_ints(config: RecurrenceConfig) -> List[int]:
    """The fields of ``config`` in order, as the custom op's schema takes them."""
    return [int(getattr(config, name)) for name in _CONFIG_FIELDS]


def _config_from_ints(values) -> RecurrenceConfig:
    fields = dict(zip(_CONFIG_FIELDS, values))
    fields.update(product=RecurrentProduct(fields["product"]), wait=StepWait(fields["wait"]),
                  fast_math=bool(fields["fast_math"]))
    return RecurrenceConfig(**fields)


@dispatch.operator("lstm_recurrence")
def lstm_recurrence_op(xw: Tensor, w_hh: Tensor, w_hh_t: Tensor, h0: Tensor, c0: Tensor, row_start: Tensor,
                       lengths: Tensor, row_step: int, zero_fill: bool,
                       config: list[int]) -> tuple[Tensor, Tensor, Tensor]:
    """One layer's recurrence, ``(out, h_n, c_n)``, as :func:`lstm_recurrence_triton`
    computes it (``config``: :func:`_config_as_ints`; ``w_hh_t`` is only read with the
    ``FOUR_GATES`` product; ``out`` is zero beyond each length when ``zero_fill``). No
    gradient."""
    num_directions, _, hidden = w_hh.shape
    out = _layer_output((xw.shape[0], num_directions * hidden), xw.dtype, xw.device, zero_fill)
    h_n, c_n = torch.empty_like(h0), torch.empty_like(c0)
    lstm_recurrence_triton(xw, w_hh, h0, c0, row_start, lengths, row_step, out, h_n, c_n,
                           _config_from_ints(config), w_hh_t)
    return out, h_n, c_n


@lstm_recurrence_op.register_fake
def _(xw, w_hh, w_hh_t, h0, c0, row_start, lengths, row_step, zero_fill, config):
    num_directions, _, hidden = w_hh.shape
    return xw.new_empty((xw.shape[0], num_directions * hidden)), torch.empty_like(h0), torch.empty_like(c0)


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
            failing = flags.nonzero()
            if failing.numel():
                raise check.error(int(failing[0, 0]))
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


class LayerWeights(NamedTuple):
    """One layer's weights as the kernels read them, every direction side by side.

    ``weight_ih`` ``(D 4H, I)``; ``bias`` ``(D 4H,)`` (``b_ih + b_hh``) or ``None``;
    ``weight_hh`` ``(D, 4H, H)``; ``weight_hh_t`` each gate's block of it transposed,
    ``(D, 4, H, H)``, or ``None`` where the product does not read it.
    """

    weight_ih: Tensor
    bias: Optional[Tensor]
    weight_hh: Tensor
    weight_hh_t: Optional[Tensor]


def layer_weights(layer: Sequence[DirectionWeights], transposed: bool) -> LayerWeights:
    """:class:`LayerWeights` of one layer (``layer[direction]``, the module's own
    parameters), with ``weight_hh_t`` when ``transposed``: one copy per weight for two
    directions, views of the parameters for one (but the summed bias and the transposed
    blocks)."""
    hidden = layer[0].weight_hh.shape[1]
    if len(layer) == 1:
        w = layer[0]
        weight_ih, weight_hh = w.weight_ih.contiguous(), w.weight_hh.contiguous().unsqueeze(0)
        bias = None if w.bias_ih is None else w.bias_ih + w.bias_hh
    else:
        weight_ih = torch.cat([w.weight_ih for w in layer])
        weight_hh = torch.stack([w.weight_hh for w in layer])
        bias = None if layer[0].bias_ih is None else torch.cat([w.bias_ih + w.bias_hh for w in layer])
    weight_hh_t = None
    if transposed:
        weight_hh_t = torch.stack([w.weight_hh.view(4, hidden, hidden).transpose(1, 2) for w in layer])
    return LayerWeights(weight_ih, bias, weight_hh, weight_hh_t)


class PersistentLSTM(torch.nn.Module):
    """Inference for a ``torch.nn.LSTM``, each layer's recurrence in one Triton launch.

    Build it with :meth:`from_torch`. It holds the ``nn.LSTM`` it was built from
    (as ``self.lstm``) and reads its parameters afresh at each call: nothing is
    cached, so every later change of them is seen, in-place ones through ``.data``
    (checkpoint loaders, EMA updates) included. Training or eval mode is the wrapped
    module's own (``self.lstm.training``), however it was set.

    Calling it is like calling the ``nn.LSTM``:

    * ``model(x)`` or ``model(x, (h0, c0))`` with ``x`` ``(B, T, I)`` when the module
      is ``batch_first``, else ``(T, B, I)``, or ``(T, I)`` unbatched, returns
      ``(y, (h_n, c_n))`` with ``y`` ``(B, T, D H)`` (or ``(T, B, D H)``, ``(T, D H)``)
      and ``h_n``, ``c_n`` ``(num_layers D, B, H)``, ``D`` = 2 if bidirectional.
      The optional keyword ``lengths`` (``(B,)``, each in ``[0, T]``) makes each
      sequence stop at its own length, as ``pack_padded_sequence`` would: ``y`` is
      zero beyond it and the reverse direction starts at frame ``lengths[b] - 1``.
    * ``model(packed)`` with a :class:`~packed_kernels.Packed` batch (``data`` ``(N,
      I)``) returns ``(Packed(y_data, cu_seqlens, lengths), (h_n, c_n))``, equal to
      ``nn.LSTM`` on the corresponding ``PackedSequence`` (any order of lengths,
      zero-length sequences allowed: they have no output rows and their final state is
      the initial one).
    * ``model(sequence)`` with a ``torch.nn.utils.rnn.PackedSequence`` returns
      ``(PackedSequence, (h_n, c_n))``, like ``nn.LSTM``.

    Float32 parameters give float32 accuracy: the recurrent sums run in IEEE float32
    on CUDA cores for small batches, and on tensor cores with three TF32 products per
    product (``tf32x3``, float32-level error) for 16-row tiles at large batches; the
    input projections are ``torch.addmm`` (keep TF32 off for them, as PyTorch does by
    default). Outputs match ``nn.LSTM`` with TF32 off to about 1e-6.

    Float16 or bfloat16 parameters (``lstm.half()``, ``lstm.to(torch.bfloat16)``) take
    inputs and states of that same dtype and give outputs in it. What is kept in which
    dtype, and why:

    * ``W_hh`` on chip in the parameters' dtype, two entries to a register: half the
      registers of float32 (at hidden 512 a thread holds 128 weights in 64 registers);
      widened to float32 at each use on CUDA cores, or multiplied as it is on tensor
      cores.
    * ``h`` in the parameters' dtype wherever it is stored or exchanged between
      programs (the exchange, the outputs, ``h_n``): each step's products read it
      rounded, as ``nn.LSTM`` in that dtype does.
    * The gate pre-activations ``x W_ih^T + b + W_hh h`` accumulated in float32 (a sum
      of ``H`` terms in float16 or bfloat16 would lose most of its digits), and the
      gates computed in float32.
    * ``c`` in float32 on chip for the whole sequence: it integrates every step
      (``c = f c + i g``), and rounding it at every step would accumulate; it is
      rounded once, into ``c_n``.
    * The input projection by ``torch.addmm`` in the parameters' dtype (on the GPU
      cuBLAS accumulates it in float32), stored in that dtype: one rounding of the
      pre-activation's input part.

    The results stay within about 1e-2 of the float32 ``nn.LSTM`` with the same
    (upcast) weights on inputs of unit scale. Mixing dtypes (a float16 module with a
    float32 input or state, say) is a ``TypeError`` naming the argument.

    When the kernels do not apply, the call runs the wrapped ``nn.LSTM`` itself, with
    the very arguments ``nn.LSTM`` would get (a ``Packed`` batch or ``lengths`` as a
    ``PackedSequence``), so its results and gradients are ``nn.LSTM``'s:

    * **autograd**: grad mode is on and the input, the initial state or a parameter
      requires grad (the kernels compute no gradient; cuDNN on a GPU is exact and
      fast). It warns once: run inference under ``torch.no_grad()`` or
      ``torch.inference_mode()`` to use the kernels. In training mode the module's
      inter-layer dropout then acts, as in ``nn.LSTM``. In eval mode on a GPU it runs
      with cuDNN off, whose backward needs training mode. (A traced call with
      ``lengths`` runs the padded PyTorch stage,
      :func:`~packed_kernels.ops.lstm.padded_torch.lstm_padded`, instead: a
      ``PackedSequence`` needs the lengths on the host.)
    * **autocast** enabled for the input's device type: ``nn.LSTM``'s dtypes and
      values under autocast (float16 and bfloat16 inputs are then accepted). It warns
      once.
    * **a tensor off the kernel device**: a CPU tensor on a machine whose kernels are
      compiled for the GPU (silently).

    Not supported (``ValueError`` or ``TypeError`` from :meth:`from_torch` or the
    call): ``proj_size > 0``; ``hidden_size`` above 512 (the recurrent weights must
    fit on chip); ``dropout > 0`` in training mode on the kernels (inter-layer dropout
    only acts in training; call ``.eval()``); parameters not all float32, all float16
    or all bfloat16.

    Types, dtypes, shapes and devices are checked on the host, within the call. The
    values of ``lengths`` (each in ``[0, T]``) and of a ``Packed`` batch
    (``packed.lengths >= 0``, ``packed.cu_seqlens == [0, cumsum(packed.lengths)]``, the
    lengths summing to the rows of ``packed.data``) are checked on the device, so that a
    call on GPU tensors never waits for the GPU; the kernels read them clamped into the
    input, so bad values give wrong outputs but no access out of bounds. A violation is a
    ``ValueError`` naming the argument and where it fails (``PersistentLSTM:
    packed.lengths must be >= 0, which fails at sequence 1``), raised within the call
    for CPU tensors and in strict mode (:func:`~packed_kernels.strict_checks`), otherwise
    by a later call into the package or by :func:`~packed_kernels.check_errors`. Where
    the wrapped ``nn.LSTM`` runs on tensors off the kernel device, they are checked on the
    host, within the call. A ``PackedSequence`` carries its lengths in ``batch_sizes``,
    on the host: nothing to check.

    Example:
        >>> import torch
        >>> from packed_kernels import PersistentLSTM, pack
        >>> lstm = torch.nn.LSTM(4, 8, bidirectional=True, batch_first=True).eval()
        >>> model = PersistentLSTM.from_torch(lstm)
        >>> x = torch.randn(3, 5, 4)  # with a GPU: lstm.cuda() and x.cuda()
        >>> with torch.inference_mode():
        ...     y, (h_n, c_n) = model(x)
        ...     out, _ = model(pack(x, [5, 2, 4]))  # 11 frames, no padding
        ...     ref, _ = lstm(x)
        >>> tuple(y.shape), tuple(h_n.shape), tuple(out.data.shape)
        ((3, 5, 16), (2, 3, 8), (11, 16))
        >>> torch.allclose(y, ref, atol=1e-5)
        True
    """

    def __init__(self, lstm: torch.nn.LSTM, config: Optional[RecurrenceConfig] = None):
        super().__init__()
        _check_module(lstm)
        if config is not None and not isinstance(config, RecurrenceConfig):
            raise TypeError(f"config must be a RecurrenceConfig or None; got {type(config).__name__}")
        self.lstm = lstm
        #: Override of the kernel configuration (``None``: :func:`choose_config` per shape and device).
        self.config = config
        self.train(lstm.training)
        self._warned: set = set()

    @classmethod
    def from_torch(cls, lstm: torch.nn.LSTM, config: Optional[RecurrenceConfig] = None) -> "PersistentLSTM":
        """Wrap an ``nn.LSTM`` (any layers, directions, bias, ``batch_first``, sizes).

        ``config`` fixes the kernels' :class:`RecurrenceConfig` for every layer (``None``:
        :func:`choose_config` picks one per call from the shape and the device).

        Example:
            >>> import torch
            >>> from packed_kernels import PersistentLSTM
            >>> lstm = torch.nn.LSTM(4, 8, batch_first=True).eval()
            >>> model = PersistentLSTM.from_torch(lstm)
            >>> model.lstm is lstm  # the module itself, not a copy
            True
            >>> x = torch.randn(2, 3, 4)
            >>> with torch.no_grad():
            ...     _ = lstm.weight_hh_l0.mul_(0.5)  # later changes of the weights are seen
            ...     y, _ = model(x)
            ...     ref, _ = lstm(x)
            >>> torch.allclose(y, ref, atol=1e-5)
            True
        """
        return cls(lstm, config)

    @property
    def num_directions(self) -> int:
        return 2 if self.lstm.bidirectional else 1

    def extra_repr(self) -> str:
        return f"config={self.config}"

    def forward(
        self,
        input: Union[torch.Tensor, Packed, PackedSequence],
        hx: Optional[State] = None,
        *,
        lengths: Optional[torch.Tensor] = None,
    ):
        """Run the stack, like ``nn.LSTM.forward``.

        Args:
            input: ``(B, T, I)`` if ``batch_first`` else ``(T, B, I)``, or ``(T, I)``
                unbatched, or a :class:`~packed_kernels.Packed` with ``data`` ``(N, I)``,
                or a ``PackedSequence``; of the parameters' dtype (outside autocast).
            hx: optional ``(h0, c0)``, each ``(num_layers D, B, H)`` (``(num_layers D,
                H)`` unbatched) of the parameters' dtype; zeros when ``None``.
            lengths: optional integer ``(B,)`` for a padded input, each in ``[0, T]``
                (a host tensor or list goes to the input's GPU without a wait).

        Returns:
            ``(output, (h_n, c_n))``: ``output`` has the input's layout with ``D H``
            features (a ``Packed`` or a ``PackedSequence`` for such an input; zeros
            beyond each length for a padded one with ``lengths``); ``h_n``, ``c_n`` are
            ``(num_layers D, B, H)``.

        Raises:
            TypeError, ValueError: a wrong type, dtype, shape or device, within the call.
            ValueError: values of ``lengths``, ``packed.lengths`` or
                ``packed.cu_seqlens`` that break their requirements, checked on the device:
                within the call for CPU tensors and in strict mode, otherwise by a later
                call into the package or :func:`~packed_kernels.check_errors` (see
                :mod:`~packed_kernels.validation`); also a violation that an earlier call
                reported, at the start of this one.
        """
        validation.raise_reported()
        lstm = self.lstm
        _check_module(lstm)
        params = list(lstm.parameters())
        if isinstance(input, PackedSequence):
            if lengths is not None:
                raise ValueError("lengths must not be given with a PackedSequence input: it carries its own")
            return self._forward_packed_sequence(input, hx, params)
        if isinstance(input, Packed):
            if lengths is not None:
                raise ValueError("lengths must not be given with a Packed input: it carries its own")
            return self._forward_packed(input, hx, params)
        if not isinstance(input, torch.Tensor):
            raise TypeError("input must be a torch.Tensor, a packed_kernels.Packed or a PackedSequence; "
                            f"got {type(input).__name__}")
        validation.check_rank("input", input, (3, 2),
                              f"{'(B, T, I)' if lstm.batch_first else '(T, B, I)'} or (T, I) unbatched")
        unbatched = input.dim() == 2
        x = input.unsqueeze(0) if unbatched else (input if lstm.batch_first else input.transpose(0, 1))
        batch, steps = x.shape[0], x.shape[1]
        self._check_data("input", x, params)
        state = self._check_state(hx, batch, "input", x, unbatched)
        traced = dispatch.is_traced(x, lengths)
        checked_on_device = False
        if lengths is not None:
            if unbatched:
                raise ValueError("lengths needs a batched input")
            lengths, checked_on_device = _check_lengths(lengths, batch, steps, x.device, traced)
        output = self._forward_padded(input, x, hx, state, lengths, unbatched, traced, params)
        if checked_on_device and not traced:
            validation.values_checked(x.device)
        return output

    def _forward_padded(self, input, x, hx, state, lengths, unbatched, traced, params):
        """A padded call once its arguments are checked (``lengths``: as the kernels read them)."""
        lstm = self.lstm
        batch, steps = x.shape[0], x.shape[1]
        if self._runs_module(x, state, params):
            if lengths is None:
                return self._run_module(input, None if hx is None else tuple(hx))
            if traced:
                if lstm.training and lstm.dropout > 0 and lstm.num_layers > 1:
                    raise ValueError("a traced call with lengths runs the padded PyTorch stage, which has no "
                                     f"dropout; the nn.LSTM has dropout={lstm.dropout}: call .eval() first")
                y, state = lstm_padded(x, lstm_weights(lstm), lengths, *(state or (None, None)))
            else:
                out, state = self._module_on_packed(pack(x, lengths), state)
                y = unpack(out, total_length=steps)
            return (y if lstm.batch_first else y.transpose(0, 1)), state
        time_major = not (lstm.batch_first or unbatched)
        rows = (input if time_major else x).reshape(batch * steps, lstm.input_size)
        y, state = self._run_kernels(rows, batch, steps, state, lengths, time_major, traced)
        if unbatched:
            return y[0], (state[0][:, 0], state[1][:, 0])
        return y, state

    # -- the kernels -----------------------------------------------------------------

    def _run_kernels(self, x_rows, batch, steps, hx, lengths, time_major, traced):
        """``x_rows`` ``(B T, I)``: row ``b T + t`` (batch first) or ``t B + b`` (time major)."""
        device = x_rows.device
        if lengths is None:
            lengths32 = torch.full((batch,), steps, dtype=torch.int32, device=device)
        else:
            lengths32 = lengths.to(torch.int32)
        if time_major:
            row_start, row_step = torch.arange(batch, dtype=torch.int64, device=device), batch
        else:
            row_start, row_step = torch.arange(batch, dtype=torch.int64, device=device) * steps, 1
        y, state = self._layers(x_rows, row_start, row_step, lengths32, hx, batch, traced,
                                zero_fill=lengths is not None, sort=lengths is not None)
        features = self.num_directions * self.lstm.hidden_size
        y = y.view(steps, batch, features) if time_major else y.view(batch, steps, features)
        return y, state

    def _forward_packed(self, packed: Packed, hx, params):
        data, cu_seqlens, lengths = packed.data, packed.cu_seqlens, packed.lengths
        validation.check_index_tensor("packed.lengths", lengths, 1, "(B,)")
        validation.check_index_tensor("packed.cu_seqlens", cu_seqlens, 1, "(B + 1,)")
        batch = lengths.numel()
        if cu_seqlens.shape != (batch + 1,):
            raise ValueError(f"packed.cu_seqlens must have shape (B + 1,) = ({batch + 1},) for the B = {batch} "
                             f"packed.lengths; got {tuple(cu_seqlens.shape)}")
        validation.check_tensor("packed.data", data)
        validation.check_rank("packed.data", data, 2, "(N, input_size)")
        self._check_data("packed.data", data, params)
        validation.check_same_device(**{"packed.data": data, "packed.cu_seqlens": cu_seqlens,
                                        "packed.lengths": lengths})
        rows = data.shape[0]
        if batch == 0 and rows:
            raise ValueError(f"packed.data has {rows} rows but packed.lengths is empty (no sequence to hold them)")
        traced = dispatch.is_traced(data, cu_seqlens, lengths)
        hx = self._check_state(hx, batch, "packed.data", data, False)
        checked_on_device = runtime.on_kernel_device(data)
        if checked_on_device:
            row_start, checked_lengths = lstm_checked_packed_op(cu_seqlens, lengths, rows)
        elif not traced:
            _report(_packed_violations(cu_seqlens.to(torch.int64), lengths.to(torch.int64), rows), on_host=True)
        if self._runs_module(data, hx, params):
            if checked_on_device:
                # nn.LSTM reads the rows the kernels would: in the data whatever the values
                checked = Packed(data, torch.cat([row_start, row_start.new_full((1,), rows)]), checked_lengths)
            else:
                checked = packed
            out, state = self._module_on_packed(checked, hx)
            y = out.data
        else:
            y, state = self._packed_kernels(data, row_start, checked_lengths.to(torch.int32), hx, traced)
        if checked_on_device and not traced:
            validation.values_checked(data.device)
        return Packed(y, cu_seqlens, lengths), state

    def _packed_kernels(self, data, row_start, lengths32, hx, traced) -> Tuple[Tensor, State]:
        """The kernels on packed rows: sequence ``b`` is rows ``row_start[b]`` to
        ``row_start[b] + lengths32[b]`` (each inside ``data``)."""
        return self._layers(data, row_start, 1, lengths32, hx, lengths32.numel(), traced, zero_fill=False, sort=True)

    def _forward_packed_sequence(self, sequence: PackedSequence, hx, params):
        data, batch_sizes = sequence.data, sequence.batch_sizes
        validation.check_rank("input.data", data, 2, "(N, input_size)")
        self._check_data("input.data", data, params)
        batch = int(batch_sizes[0]) if batch_sizes.numel() else 0  # batch_sizes lives on the host
        state = self._check_state(hx, batch, "input.data", data, False)
        if self._runs_module(data, state, params):
            return self._run_module(sequence, None if hx is None else tuple(hx))
        traced = dispatch.is_traced(data)
        rows, lengths = _packed_rows(batch_sizes, sequence.sorted_indices, data.device, traced)
        row_start = torch.cumsum(lengths, 0) - lengths
        out, state = self._packed_kernels(data.new_empty(data.shape).index_copy_(0, rows, data), row_start,
                                          lengths.to(torch.int32), state, traced)
        return PackedSequence(out[rows], batch_sizes, sequence.sorted_indices, sequence.unsorted_indices), state

    def _layers(self, x_rows, row_start, row_step, lengths32, hx, batch, traced, zero_fill, sort):
        lstm = self.lstm
        D, H = self.num_directions, lstm.hidden_size
        device = x_rows.device
        n_states = lstm.num_layers * D
        dtype = x_rows.dtype  # the parameters' (checked)
        config = self.config
        if config is None:
            config = choose_config(batch, H, D, device, frames=x_rows.shape[0], dtype=dtype)
        transposed = config.product == RecurrentProduct.FOUR_GATES
        if traced:
            config_ints = _config_as_ints(config)
            h_layers, c_layers = [], []
        else:
            h_n = torch.empty((n_states, batch, H), dtype=dtype, device=device)
            c_n = torch.empty_like(h_n)
        if hx is None:
            h0 = c0 = torch.zeros((n_states, batch, H), dtype=dtype, device=device)
        else:
            h0, c0 = hx[0].contiguous(), hx[1].contiguous()
        order = None
        if sort and batch > 1:
            # Sequences of similar length share a batch tile (a tile runs until its longest
            # sequence ends) and a launch. Only the per-sequence indices and states move:
            # the kernel finds every frame through row_start.
            order = torch.argsort(lengths32, descending=True, stable=True)
            row_start, lengths32 = row_start[order], lengths32[order]
            h0, c0 = h0[:, order].contiguous(), c0[:, order].contiguous()
        layer_input = x_rows.contiguous()
        for layer, directions in enumerate(lstm_weights(lstm)):
            # Read from the parameters at every call: an in-place change through .data
            # leaves no trace (no version bump) that a cache could check.
            w_ih, bias, w_hh, w_hh_t = layer_weights(directions, transposed)
            # The previous layer's output is read by this projection only, and this layer's
            # projected inputs by its recurrence only: each is dropped after its last use,
            # so a layer holds no more than its own projected inputs and output.
            xw = _input_projection(layer_input, w_ih, bias)
            del layer_input
            states = slice(layer * D, (layer + 1) * D)
            if traced:
                out, h_layer, c_layer = lstm_recurrence_op.custom_op(
                    xw, w_hh, w_hh if w_hh_t is None else w_hh_t, h0[states], c0[states], row_start, lengths32,
                    row_step, zero_fill, config_ints)
                h_layers.append(h_layer)
                c_layers.append(c_layer)
            else:
                out = _layer_output((xw.shape[0], D * H), dtype, device, zero_fill)
                lstm_recurrence_triton(xw, w_hh, h0[states], c0[states], row_start, lengths32, row_step, out,
                                       h_n[states], c_n[states], config, w_hh_t)
            layer_input = out
            del xw, out
        if traced:
            h_n, c_n = torch.cat(h_layers), torch.cat(c_layers)
        if order is not None:
            h_n = torch.empty_like(h_n).index_copy_(1, order, h_n)
            c_n = torch.empty_like(c_n).index_copy_(1, order, c_n)
        return layer_input, (h_n, c_n)

    # -- the wrapped nn.LSTM ---------------------------------------------------------

    def _runs_module(self, data, hx, params) -> bool:
        """Whether this call runs the wrapped ``nn.LSTM`` rather than the kernels; says
        why, once per reason."""
        if not runtime.on_kernel_device(data):
            return True  # a CPU tensor where the kernels are compiled for the GPU
        if runtime.autocast_enabled(data.device.type):
            self._say_once("autocast", f"autocast is enabled for {data.device.type}, so this call runs the wrapped "
                           "nn.LSTM, which gives nn.LSTM's dtypes and values under autocast; the Triton kernels "
                           "run outside autocast, in the dtype of the parameters")
            return True
        if self._needs_autograd(data, hx, params):
            self._say_once("autograd", "a gradient is needed (grad mode is on and the input, the initial state or "
                           "a parameter requires grad), so this call runs the wrapped nn.LSTM (exact gradients; "
                           "cuDNN on a GPU) instead of the inference-only Triton kernels; run inference under "
                           "torch.no_grad() or torch.inference_mode() to use the kernels")
            return True
        lstm = self.lstm
        if lstm.training and lstm.dropout > 0 and lstm.num_layers > 1:
            raise ValueError(
                f"PersistentLSTM runs inference: the nn.LSTM has dropout={lstm.dropout} between layers, "
                "which only acts in training mode; call .eval() first"
            )
        return False

    def _say_once(self, reason: str, message: str) -> None:
        if reason not in self._warned:
            self._warned.add(reason)
            warnings.warn(f"PersistentLSTM: {message}", UserWarning, stacklevel=_stacklevel_of_caller())

    def _run_module(self, input, hx):
        """The wrapped ``nn.LSTM`` on ``input``. cuDNN differentiates an RNN only in
        training mode, so a module in eval mode that needs a gradient on a GPU runs
        PyTorch's native LSTM instead (the same maths; dropout is off in eval mode)."""
        data = input.data if isinstance(input, PackedSequence) else input
        if not self.lstm.training and data.is_cuda and torch.is_grad_enabled():
            with torch.backends.cudnn.flags(enabled=False):
                return self.lstm(input, hx)
        return self.lstm(input, hx)

    def _module_on_packed(self, packed: Packed, hx) -> Tuple[Packed, State]:
        """The wrapped ``nn.LSTM`` on the ``PackedSequence`` of ``packed``. A
        ``PackedSequence`` holds no empty sequence: those are left out of the call, have
        no output rows, and keep their initial state."""
        lstm, lengths = self.lstm, packed.lengths
        nonempty = torch.nonzero(lengths > 0).flatten()
        if nonempty.numel() == lengths.numel() and lengths.numel():
            out, state = self._run_module(packed.to_packed_sequence(), hx)
            return Packed(_packed_data(out), packed.cu_seqlens, lengths), state
        if hx is None:
            shape = (lstm.num_layers * self.num_directions, lengths.numel(), lstm.hidden_size)
            hx = (packed.data.new_zeros(shape), packed.data.new_zeros(shape))
        if nonempty.numel() == 0:  # nothing for nn.LSTM to run
            y = packed.data.new_empty((0, self.num_directions * lstm.hidden_size))
            return Packed(y, packed.cu_seqlens, lengths), (hx[0].clone(), hx[1].clone())
        kept_lengths = lengths[nonempty]
        # the kept sequences' own starts (the cumulative sums of their lengths where the
        # offsets are valid; inside the data where they were clamped)
        kept = Packed(packed.data, torch.cat([packed.cu_seqlens[:-1][nonempty], packed.cu_seqlens[-1:]]),
                      kept_lengths)
        out, (h_kept, c_kept) = self._run_module(kept.to_packed_sequence(), (hx[0][:, nonempty], hx[1][:, nonempty]))
        h_n = hx[0].to(h_kept.dtype).index_copy(1, nonempty, h_kept)
        c_n = hx[1].to(c_kept.dtype).index_copy(1, nonempty, c_kept)
        return Packed(_packed_data(out), packed.cu_seqlens, lengths), (h_n, c_n)

    # -- checks ----------------------------------------------------------------------

    @staticmethod
    def _needs_autograd(x, hx, params) -> bool:
        if not torch.is_grad_enabled():
            return False
        tensors = [x, *params] + ([] if hx is None else list(hx))
        return any(t.requires_grad for t in tensors)

    def _check_data(self, name, x, params):
        lstm = self.lstm
        # outside autocast, the parameters' dtype (checked to be one of PARAMETER_DTYPES)
        dtypes = AUTOCAST_DTYPES if runtime.autocast_enabled(x.device.type) else (params[0].dtype,)
        validation.check_float_tensor(name, x, dtypes=dtypes)
        if x.shape[-1] != lstm.input_size:
            raise ValueError(
                f"{name} must have {lstm.input_size} features (the nn.LSTM's input_size) in its last "
                f"dimension; got shape {tuple(x.shape)}"
            )
        if x.device != params[0].device:
            raise ValueError(f"{name} must be on the device of the nn.LSTM's parameters ({params[0].device}); "
                             f"got {x.device}")

    def _check_state(self, hx, batch, x_name, x, unbatched):
        if hx is None:
            return None
        if not isinstance(hx, (tuple, list)) or len(hx) != 2:
            raise TypeError(f"hx must be a tuple (h0, c0), as for nn.LSTM; got {type(hx).__name__}")
        lstm = self.lstm
        expected = (lstm.num_layers * self.num_directions, lstm.hidden_size) if unbatched else (
            lstm.num_layers * self.num_directions, batch, lstm.hidden_size)
        dtypes = AUTOCAST_DTYPES if runtime.autocast_enabled(x.device.type) else (lstm.weight_hh_l0.dtype,)
        checked = []
        for name, t in zip(("h0", "c0"), hx):
            validation.check_float_tensor(name, t, dtypes=dtypes)
            if tuple(t.shape) != expected:
                raise ValueError(f"{name} must have shape {expected}; got {tuple(t.shape)}")
            validation.check_same_device(**{x_name: x, name: t})
            checked.append(t.unsqueeze(1) if unbatched else t)
        return tuple(checked)


def _input_projection(x: Tensor, w_ih: Tensor, bias: Optional[Tensor]) -> Tensor:
    """``x W_ih^T + bias`` for every frame of a layer, both directions in one product
    (columns ``d 4H + gate H + unit``). Float32 products with wide inputs run on tensor
    cores (:func:`input_projection_triton`); float16 and bfloat16 ones already do in cuBLAS."""
    if runtime.INTERPRETED or x.shape[1] < TENSOR_CORE_PROJECTION_MIN_K or x.dtype != torch.float32:
        return x @ w_ih.T if bias is None else torch.addmm(bias, x, w_ih.T)
    return input_projection_triton(x, w_ih, bias)


def _layer_output(shape, dtype: torch.dtype, device: torch.device, zero_fill: bool) -> Tensor:
    """A layer's output rows, zeros with ``zero_fill`` (rows of padding frames that the
    recurrence leaves unwritten)."""
    return (torch.zeros if zero_fill else torch.empty)(shape, dtype=dtype, device=device)


_INNER_FILES = (os.path.dirname(os.path.dirname(os.path.dirname(__file__))), os.path.dirname(torch.nn.__file__))


def _stacklevel_of_caller() -> int:
    """The ``stacklevel`` of the first frame outside the package and ``torch.nn`` (the
    user's call of the module), as warnings.warn counts from this function's caller."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_INNER_FILES):
        frame, level = frame.f_back, level + 1
    return level


def _packed_data(sequence: PackedSequence) -> Tensor:
    """The rows of ``sequence`` in the order of a :class:`Packed` batch (sequence after
    sequence, in their original order); differentiable."""
    data = sequence.data
    rows, _ = _packed_rows(sequence.batch_sizes, sequence.sorted_indices, data.device, dispatch.is_traced(data))
    return data.new_empty(data.shape).index_copy(0, rows, data)


def _on_device(t: Tensor, device: torch.device, traced: bool) -> Tensor:
    """``t`` on ``device``. A host tensor goes to a GPU through pinned memory, without a
    wait: a copy from pageable memory waits for the work queued on the GPU."""
    if t.device.type == "cpu" and device.type == "cuda" and not traced:
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _packed_rows(batch_sizes: Tensor, sorted_indices: Optional[Tensor], device, traced: bool) -> Tuple[Tensor, Tensor]:
    """For a ``PackedSequence`` layout (``batch_sizes``, ``sorted_indices``): the row of a
    :class:`Packed` batch of the same sequences (in their original order) that each of
    its rows holds, and the length of each sequence (int64), both on ``device``.

    Row ``r`` of the ``PackedSequence`` is time step ``t`` of the sequence of rank ``k``
    (``k``-th longest), ``sorted_indices[k]``; ties in length are in whatever order
    ``sorted_indices`` says. What depends on ``batch_sizes`` alone is computed on the host,
    where a ``PackedSequence`` keeps it, and goes to the device in one copy; the rest is
    computed there. A sequence that ``sorted_indices`` names no rank of has length 0, so
    the lengths never sum to more than the rows.
    """
    batch_sizes = batch_sizes.to(torch.int64)
    batch = int(batch_sizes[0]) if batch_sizes.numel() else 0
    total = int(batch_sizes.sum())
    sorted_lengths = (batch_sizes[None, :] > torch.arange(batch)[:, None]).sum(1)
    step_starts = torch.cumsum(batch_sizes, 0) - batch_sizes  # the first row of each time step
    on_device = _on_device(torch.cat([sorted_lengths, step_starts]), device, traced)
    sorted_lengths, step_starts = on_device[:batch], on_device[batch:]
    row = torch.arange(total, device=device)
    step_of_row = torch.searchsorted(step_starts, row, right=True) - 1
    rank_of_row = row - step_starts[step_of_row]
    if sorted_indices is None:
        sorted_indices = torch.arange(batch, device=device)
    lengths = torch.zeros(batch, dtype=torch.int64, device=device).index_copy_(0, sorted_indices, sorted_lengths)
    starts = torch.cumsum(lengths, 0) - lengths
    rows = starts[sorted_indices[rank_of_row]] + step_of_row
    return rows, lengths


def _check_module(lstm) -> None:
    if not isinstance(lstm, torch.nn.LSTM):
        raise TypeError(f"lstm must be a torch.nn.LSTM; got {type(lstm).__name__}")
    if lstm.proj_size > 0:
        raise ValueError(f"nn.LSTM with proj_size={lstm.proj_size} (projections) is not supported; need proj_size=0")
    if lstm.hidden_size > MAX_HIDDEN:
        raise ValueError(
            f"nn.LSTM with hidden_size={lstm.hidden_size} is not supported: the kernels keep the recurrent "
            f"weights on chip, which allows hidden_size up to {MAX_HIDDEN}"
        )
    named = list(lstm.named_parameters())
    first_name, first = named[0]
    for name, p in named:
        if p.dtype not in PARAMETER_DTYPES:
            raise TypeError(f"the nn.LSTM's parameters must be float32, float16 or bfloat16; got {name} of dtype "
                            f"{p.dtype}")
        if p.dtype != first.dtype:
            raise TypeError(f"the nn.LSTM's parameters must all have one dtype; got {first_name} of dtype "
                            f"{first.dtype} and {name} of dtype {p.dtype}")


def _check_lengths(lengths, batch, steps, device, traced) -> Tuple[Tensor, bool]:
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
    lengths = _on_device(lengths.to(torch.int64), device, traced)
    if runtime.on_kernel_device(lengths):
        return lstm_checked_lengths_op(lengths, steps), True
    if not traced:
        _report(_lengths_violations(lengths, steps), on_host=True)
    return lengths, False
