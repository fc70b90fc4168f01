"""``PersistentLSTM``: an ``nn.LSTM`` run by one persistent Triton launch per layer.

A call goes through three parts:

* the input adapter (:mod:`.inputs`): a padded tensor (with optional ``lengths``), an
  unbatched sequence, a :class:`~packed_kernels.Packed` batch or a ``PackedSequence``,
  checked, as rows the kernels read (row starts, row step, lengths read clamped), with
  the way back to the caller's form;
* the runner (:func:`run_layers`): for each layer, the input projection of every frame
  as one matrix product, then one launch of the recurrence;
* the fallback: where a call needs what the kernels do not give (a gradient, autocast, a
  tensor off the kernel device), the wrapped ``nn.LSTM`` itself, which says why once.

The call's mode (:func:`~packed_kernels.dispatch.call_mode`) is decided once, from the
input's tensors, and handed to every operator it runs: a traced call runs each layer's
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
from ...dispatch import EAGER, TRACED
from ...packing import Packed
from .inputs import KernelInput, LSTMInput, adapt_input
from .module_view import ModuleView, check_lstm, check_supported
from .padded_torch import DirectionWeights, lstm_weights
from .triton_kernels import (
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
    (as ``self.lstm``) and reads its attributes and parameters afresh at each call,
    where the module keeps them (:class:`~.module_view.ModuleView`): nothing is
    cached, so every later change of them is seen, in-place ones through ``.data``
    (checkpoint loaders, EMA updates) included. Training or eval mode is the wrapped
    module's own (``self.lstm.training``), however it was set. Another ``nn.LSTM``
    assigned to ``self.lstm`` is checked as :meth:`from_torch` checks one, and wrapped.

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

    Not supported (``ValueError`` or ``TypeError`` from :meth:`from_torch`, an
    assignment to ``self.lstm`` or the call): ``proj_size > 0``; ``hidden_size`` above 512 (the recurrent weights must
    fit on chip); ``dropout > 0`` in training mode on the kernels (inter-layer dropout
    only acts in training; call ``.eval()``); parameters not all float32, all float16
    or all bfloat16.

    Under ``torch.compile``, a call that runs the kernels (no gradient needed: under
    ``torch.no_grad()`` or ``torch.inference_mode()``) traces as one graph, also with
    ``fullgraph=True``, for every input form: each layer's recurrence and the value checks
    are custom ops (``packed_kernels::lstm_recurrence``, ``lstm_checked_lengths``,
    ``lstm_checked_packed``), and the wrapped ``nn.LSTM`` object is never traced (Dynamo
    refuses one unless ``torch._dynamo.config.allow_rnn``): the call reads the module's
    attributes and parameters where the module keeps them, with a guard on each, so a
    changed mode or attribute recompiles and a parameter changed in place (``.data``
    included) or replaced is read by the next compiled call. One exception: a
    ``PackedSequence`` without ``sorted_indices`` (built with ``enforce_sorted=True``)
    tells its number of sequences only in the values of ``batch_sizes``, a read Dynamo
    cannot trace: ``fullgraph=True`` raises there (a
    ``torch._dynamo.exc.TorchDynamoException``), and without it the graph breaks at that
    read and the results are the eager call's. Where the call runs the wrapped
    ``nn.LSTM`` instead (a gradient needed, autocast, a tensor off the kernel device),
    Dynamo traces neither the warning that says why nor the ``nn.LSTM`` (unless
    ``allow_rnn``): ``fullgraph=True`` raises ``torch._dynamo.exc.Unsupported``, and
    without it the graph breaks there and the call runs the ``nn.LSTM`` as an eager call
    does, with its results and gradients and the same warning. A compiled call's value
    checks report to the next eager call into the package or to
    :func:`~packed_kernels.check_errors`.

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
        self.lstm = lstm
        if config is not None and not isinstance(config, RecurrenceConfig):
            raise TypeError(f"config must be a RecurrenceConfig or None; got {type(config).__name__}")
        #: Override of the kernel configuration (``None``: :func:`choose_config` per shape and device).
        self.config = config
        self.train(lstm.training)
        self._warned: set = set()

    def __setattr__(self, name: str, value) -> None:
        if name != "lstm":
            super().__setattr__(name, value)
            return
        check_lstm(value)
        super().__setattr__(name, value)
        # what every call reads of the module (the kernels' path reads nothing else of it)
        super().__setattr__("_view", ModuleView(value))

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
        return 2 if self._view.bidirectional else 1

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
        module = self._view
        check_supported(module)
        call = adapt_input(input, hx, lengths, module)
        if self._runs_module(call):
            output = call.module_output(self._run_module)
        else:
            output = call.output(*run_layers(module, call.kernel_input(), call.state, self.config, call.mode))
        if call.checked_on_device and call.mode is not TRACED:
            validation.values_checked(call.data.device)
        return output

    # -- the fallback: the wrapped nn.LSTM ---------------------------------------------

    def _runs_module(self, call: LSTMInput) -> bool:
        """Whether this call runs the wrapped ``nn.LSTM`` rather than the kernels; says
        why, once per reason."""
        data, module = call.data, call.module
        if not runtime.on_kernel_device(data):
            return True  # a CPU tensor where the kernels are compiled for the GPU
        if runtime.autocast_enabled(data.device.type):
            self._say_once("autocast", f"autocast is enabled for {data.device.type}, so this call runs the wrapped "
                           "nn.LSTM, which gives nn.LSTM's dtypes and values under autocast; the Triton kernels "
                           "run outside autocast, in the dtype of the parameters")
            return True
        if _needs_autograd(data, call.state, module):
            self._say_once("autograd", "a gradient is needed (grad mode is on and the input, the initial state or "
                           "a parameter requires grad), so this call runs the wrapped nn.LSTM (exact gradients; "
                           "cuDNN on a GPU) instead of the inference-only Triton kernels; run inference under "
                           "torch.no_grad() or torch.inference_mode() to use the kernels")
            return True
        if module.training and module.dropout > 0 and module.num_layers > 1:
            raise ValueError(
                f"PersistentLSTM runs inference: the nn.LSTM has dropout={module.dropout} between layers, "
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


def _needs_autograd(data: Tensor, hx: Optional[State], module: ModuleView) -> bool:
    if not torch.is_grad_enabled():
        return False
    tensors = [data, *module.parameters()] + ([] if hx is None else list(hx))
    return any(t.requires_grad for t in tensors)


# -- the runner: the kernels, layer after layer -------------------------------------------

def run_layers(module: ModuleView, input: KernelInput, hx: Optional[State], config: Optional[RecurrenceConfig],
               mode: str) -> Tuple[Tensor, State]:
    """The stacked LSTM by the kernels: ``(y, (h_n, c_n))``, ``y`` the last layer's output
    rows (one per row of ``input.rows``, ``D H`` features; zero where no sequence has a
    frame with ``input.zero_fill``), ``h_n`` and ``c_n`` ``(num_layers D, B, H)``.

    Each layer computes the input projection of every frame, both directions in one
    product (:func:`_input_projection`), then runs its whole recurrence in one launch of
    :func:`lstm_recurrence_triton`, which finds frame ``t`` of sequence ``b`` at row
    ``row_start[b] + t row_step``. An eager call (``mode``, from
    :func:`~packed_kernels.dispatch.call_mode`) launches it directly, into slices of
    ``h_n`` and ``c_n``; any other runs :data:`lstm_recurrence_op` as
    :meth:`~packed_kernels.dispatch.Operator.run` takes that mode (traced: the custom op).
    ``config`` ``None``: :func:`choose_config` for the shape and the device.
    """
    D, H = (2 if module.bidirectional else 1), module.hidden_size
    x_rows, row_start, lengths32, batch = input.rows, input.row_start, input.lengths, input.batch
    device = x_rows.device
    n_states = module.num_layers * D
    dtype = x_rows.dtype  # the parameters' (checked)
    if config is None:
        config = choose_config(batch, H, D, device, frames=x_rows.shape[0], dtype=dtype)
    transposed = config.product == RecurrentProduct.FOUR_GATES
    eager = mode is EAGER
    if eager:
        h_n = torch.empty((n_states, batch, H), dtype=dtype, device=device)
        c_n = torch.empty_like(h_n)
    else:
        config_ints = _config_as_ints(config)
        h_layers, c_layers = [], []
    if hx is None:
        h0 = c0 = torch.zeros((n_states, batch, H), dtype=dtype, device=device)
    else:
        h0, c0 = hx[0].contiguous(), hx[1].contiguous()
    order = None
    if input.sort and batch > 1:
        # Sequences of similar length share a batch tile (a tile runs until its longest
        # sequence ends) and a launch. Only the per-sequence indices and states move:
        # the kernel finds every frame through row_start.
        order = torch.argsort(lengths32, descending=True, stable=True)
        row_start, lengths32 = row_start[order], lengths32[order]
        h0, c0 = h0[:, order].contiguous(), c0[:, order].contiguous()
    layer_input = x_rows.contiguous()
    for layer, directions in enumerate(lstm_weights(module)):
        # Read from the parameters at every call: an in-place change through .data
        # leaves no trace (no version bump) that a cache could check.
        w_ih, bias, w_hh, w_hh_t = layer_weights(directions, transposed)
        # The previous layer's output is read by this projection only, and this layer's
        # projected inputs by its recurrence only: each is dropped after its last use,
        # so a layer holds no more than its own projected inputs and output.
        xw = _input_projection(layer_input, w_ih, bias)
        del layer_input
        states = slice(layer * D, (layer + 1) * D)
        if eager:
            out = _layer_output((xw.shape[0], D * H), dtype, device, input.zero_fill)
            lstm_recurrence_triton(xw, w_hh, h0[states], c0[states], row_start, lengths32, input.row_step, out,
                                   h_n[states], c_n[states], config, w_hh_t)
        else:
            out, h_layer, c_layer = lstm_recurrence_op.run(
                mode, xw, w_hh, w_hh if w_hh_t is None else w_hh_t, h0[states], c0[states], row_start, lengths32,
                input.row_step, input.zero_fill, config_ints)
            h_layers.append(h_layer)
            c_layers.append(c_layer)
        layer_input = out
        del xw, out
    if not eager:
        h_n, c_n = torch.cat(h_layers), torch.cat(c_layers)
    if order is not None:
        h_n = torch.empty_like(h_n).index_copy_(1, order, h_n)
        c_n = torch.empty_like(c_n).index_copy_(1, order, c_n)
    return layer_input, (h_n, c_n)


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
    user's call of the module), as warnings.warn counts from this function's caller;
    1 while Dynamo traces."""
    if torch.compiler.is_compiling():
        return 1  # Dynamo cannot trace a walk over the frames; the warning then names this module
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_INNER_FILES):
        frame, level = frame.f_back, level + 1
    return level
