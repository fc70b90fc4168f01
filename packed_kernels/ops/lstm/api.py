"""``PersistentLSTM``: an ``nn.LSTM`` run by one persistent Triton launch per layer.

Inference only. A traced call (:func:`~packed_kernels.dispatch.is_traced`) runs each
layer's recurrence as the custom op ``packed_kernels::lstm_recurrence``, which has no
gradient formula; an eager call launches the kernels directly.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import List, Optional, Tuple, Union

import torch
from torch import Tensor

from ... import dispatch, runtime, validation
from ...packing import Packed, cu_seqlens_from_lengths, unpack
from .padded_torch import lstm_padded, lstm_weights
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
    computes it (``config``: :func:`_config_as_ints`; ``out`` is zero beyond each length
    when ``zero_fill``). No gradient."""
    num_directions, _, hidden = w_hh.shape
    alloc = torch.zeros if zero_fill else torch.empty
    out = alloc((xw.shape[0], num_directions * hidden), dtype=torch.float32, device=xw.device)
    h_n, c_n = torch.empty_like(h0), torch.empty_like(c0)
    lstm_recurrence_triton(xw, w_hh, h0, c0, row_start, lengths, row_step, out, h_n, c_n,
                           _config_from_ints(config), w_hh_t)
    return out, h_n, c_n


@lstm_recurrence_op.register_fake
def _(xw, w_hh, w_hh_t, h0, c0, row_start, lengths, row_step, zero_fill, config):
    num_directions, _, hidden = w_hh.shape
    return xw.new_empty((xw.shape[0], num_directions * hidden)), torch.empty_like(h0), torch.empty_like(c0)


class PersistentLSTM(torch.nn.Module):
    """Inference for a ``torch.nn.LSTM``, each layer's recurrence in one Triton launch.

    Build it with :meth:`from_torch`. It holds the ``nn.LSTM`` it was built from
    (as ``self.lstm``) and uses its parameters as they are at each call: nothing is
    copied, so later updates of the module are seen.

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
      zero-length sequences allowed: their final state is the initial one).

    Float32 only, with float32 accuracy: the recurrent sums run in IEEE float32 on
    CUDA cores for small batches, and on tensor cores with three TF32 products per
    product (``tf32x3``, float32-level error) for 16-row tiles at large batches; the
    input projections are ``torch.addmm`` (keep TF32 off for them, as PyTorch does by
    default). Outputs match ``nn.LSTM`` with TF32 off to about 1e-6.

    Autograd: the Triton path computes no gradient. When a gradient is needed
    (grad mode on and the input, the initial state or a parameter requires grad),
    the call falls back to the padded PyTorch stage
    (:func:`~packed_kernels.ops.lstm.padded_torch.lstm_padded`), which gives the exact
    gradient through ordinary autograd, and warns once that it did. Run inference
    under ``torch.no_grad()`` or ``torch.inference_mode()`` to use the kernels.

    Not supported (``ValueError`` or ``TypeError`` from :meth:`from_torch` or the
    call): ``proj_size > 0``; ``hidden_size`` above 512 (the recurrent weights must
    fit on chip); ``dropout > 0`` while in training mode (inter-layer dropout only
    acts in training; call ``.eval()``); parameters not float32.
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
        self._prepared_key = None
        self._prepared: List[Tuple[torch.Tensor, ...]] = []
        self._warned_fallback = False

    @classmethod
    def from_torch(cls, lstm: torch.nn.LSTM, config: Optional[RecurrenceConfig] = None) -> "PersistentLSTM":
        """Wrap an ``nn.LSTM`` (any layers, directions, bias, ``batch_first``, sizes)."""
        return cls(lstm, config)

    @property
    def num_directions(self) -> int:
        return 2 if self.lstm.bidirectional else 1

    def extra_repr(self) -> str:
        return f"config={self.config}"

    def forward(
        self,
        input: Union[torch.Tensor, Packed],
        hx: Optional[State] = None,
        *,
        lengths: Optional[torch.Tensor] = None,
    ):
        """Run the stack, like ``nn.LSTM.forward``.

        Args:
            input: float32 ``(B, T, I)`` if ``batch_first`` else ``(T, B, I)``, or
                ``(T, I)`` unbatched, or a :class:`~packed_kernels.Packed` with
                ``data`` ``(N, I)``.
            hx: optional ``(h0, c0)``, each float32 ``(num_layers D, B, H)`` (``(num_layers
                D, H)`` unbatched); zeros when ``None``.
            lengths: optional integer ``(B,)`` for a padded input, each in ``[0, T]``.

        Returns:
            ``(output, (h_n, c_n))``: ``output`` has the input's layout with ``D H``
            features (a ``Packed`` for a packed input; zeros beyond each length for a
            padded one with ``lengths``); ``h_n``, ``c_n`` are ``(num_layers D, B, H)``.
        """
        lstm = self.lstm
        _check_module(lstm)
        if self.training and lstm.dropout > 0 and lstm.num_layers > 1:
            raise ValueError(
                f"PersistentLSTM runs inference: the nn.LSTM has dropout={lstm.dropout} between layers, "
                "which only acts in training mode; call .eval() first"
            )
        params = list(lstm.parameters())
        if isinstance(input, Packed):
            if lengths is not None:
                raise ValueError("lengths must not be given with a Packed input: it carries its own")
            return self._forward_packed(input, hx, params)
        if isinstance(input, torch.nn.utils.rnn.PackedSequence):
            raise TypeError(
                "input is a torch PackedSequence; pass a packed_kernels.Packed instead "
                "(packed_kernels.pack(padded, lengths))"
            )
        if not isinstance(input, torch.Tensor):
            raise TypeError(f"input must be a torch.Tensor or a packed_kernels.Packed; got {type(input).__name__}")
        validation.check_rank("input", input, (3, 2),
                              f"{'(B, T, I)' if lstm.batch_first else '(T, B, I)'} or (T, I) unbatched")
        unbatched = input.dim() == 2
        x = input.unsqueeze(0) if unbatched else (input if lstm.batch_first else input.transpose(0, 1))
        batch, steps = x.shape[0], x.shape[1]
        self._check_data("input", x, params)
        hx = self._check_state(hx, batch, "input", x, unbatched)
        traced = dispatch.is_traced(x)
        if lengths is not None:
            if unbatched:
                raise ValueError("lengths needs a batched input")
            lengths = _check_lengths(lengths, batch, steps, x.device, traced)
        if self._needs_autograd(x, hx, params):
            y, state = self._fallback(x, hx, lengths)  # batch first
            if not (lstm.batch_first or unbatched):
                y = y.transpose(0, 1)
        else:
            time_major = not (lstm.batch_first or unbatched)
            rows = (input if time_major else x).reshape(batch * steps, lstm.input_size)
            y, state = self._run_kernels(rows, batch, steps, hx, lengths, time_major, params, traced)
        if unbatched:
            return y[0], (state[0][:, 0], state[1][:, 0])
        return y, state

    # -- the two paths ---------------------------------------------------------------

    def _run_kernels(self, x_rows, batch, steps, hx, lengths, time_major, params, traced):
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
        y, state = self._layers(x_rows, row_start, row_step, lengths32, hx, batch, params, traced,
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
        traced = dispatch.is_traced(data, cu_seqlens, lengths)
        if not traced:
            if batch and int(lengths.min()) < 0:
                raise ValueError(f"packed.lengths must be >= 0; got min {int(lengths.min())}")
            expected = cu_seqlens_from_lengths(lengths.to(torch.int64)).to(torch.int64)
            if not torch.equal(cu_seqlens.to(torch.int64), expected):
                raise ValueError("packed.cu_seqlens must be [0, cumsum(packed.lengths)] (a Packed from pack())")
            if int(expected[-1]) != data.shape[0]:
                raise ValueError(
                    f"packed.data has {data.shape[0]} rows but packed.lengths sum to {int(expected[-1])}"
                )
        hx = self._check_state(hx, batch, "packed.data", data, False)
        if self._needs_autograd(data, hx, params):
            padded = unpack(packed)
            y, state = self._fallback(padded, hx, lengths)
            mask = torch.arange(padded.shape[1], device=data.device)[None, :] < lengths[:, None]
            return Packed(y[mask], cu_seqlens, lengths), state
        y, state = self._layers(data, cu_seqlens[:-1].to(torch.int64), 1, lengths.to(torch.int32), hx, batch,
                                params, traced, zero_fill=False, sort=True)
        return Packed(y, cu_seqlens, lengths), state

    def _layers(self, x_rows, row_start, row_step, lengths32, hx, batch, params, traced, zero_fill, sort):
        lstm = self.lstm
        D, H = self.num_directions, lstm.hidden_size
        device = x_rows.device
        n_states = lstm.num_layers * D
        config = self.config
        if config is None:  # (an empty batch launches nothing: any configuration will do)
            config = choose_config(max(batch, 1), H, D, device, frames=x_rows.shape[0])
        if traced:
            config_ints = _config_as_ints(config)
            h_layers, c_layers = [], []
        else:
            h_n = torch.empty((n_states, batch, H), dtype=torch.float32, device=device)
            c_n = torch.empty_like(h_n)
        if hx is None:
            h0 = c0 = torch.zeros((n_states, batch, H), dtype=torch.float32, device=device)
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
        for layer, (w_ih, bias, w_hh, w_hh_t) in enumerate(self._prepare(params)):
            # One product for every frame and both directions: columns d * 4H + gate * H + unit.
            if runtime.INTERPRETED or layer_input.shape[1] < TENSOR_CORE_PROJECTION_MIN_K:
                xw = layer_input @ w_ih.T if bias is None else torch.addmm(bias, layer_input, w_ih.T)
            else:
                xw = input_projection_triton(layer_input, w_ih, bias)
            states = slice(layer * D, (layer + 1) * D)
            if traced:
                out, h_layer, c_layer = lstm_recurrence_op.custom_op(
                    xw, w_hh, w_hh_t, h0[states], c0[states], row_start, lengths32, row_step, zero_fill, config_ints)
                h_layers.append(h_layer)
                c_layers.append(c_layer)
            else:
                alloc = torch.zeros if zero_fill else torch.empty
                out = alloc((layer_input.shape[0], D * H), dtype=torch.float32, device=device)
                lstm_recurrence_triton(xw, w_hh, h0[states], c0[states], row_start, lengths32, row_step, out,
                                       h_n[states], c_n[states], config, w_hh_t)
            layer_input = out
        if traced:
            h_n, c_n = torch.cat(h_layers), torch.cat(c_layers)
        if order is not None:
            h_n = torch.empty_like(h_n).index_copy_(1, order, h_n)
            c_n = torch.empty_like(c_n).index_copy_(1, order, c_n)
        return layer_input, (h_n, c_n)

    def _prepare(self, params):
        """Per layer: ``W_ih`` of all directions ``(D 4H, I)``, summed biases ``(D 4H,)``,
        ``W_hh`` ``(D, 4H, H)`` and each gate's block of it transposed, ``(D, 4, H, H)``.

        Cached until a parameter (of ``params``, the module's) changes: its storage or its
        in-place version counter.
        """
        key = tuple((p.data_ptr(), p._version, p.device) for p in params)
        if key != self._prepared_key:
            prepared = []
            with torch.no_grad():
                for layer in lstm_weights(self.lstm):
                    w_ih = torch.cat([w.weight_ih for w in layer]).contiguous()
                    bias = None
                    if layer[0].bias_ih is not None:
                        bias = torch.cat([w.bias_ih + w.bias_hh for w in layer]).contiguous()
                    w_hh = torch.stack([w.weight_hh for w in layer]).contiguous()
                    H = w_hh.shape[2]
                    w_hh_t = w_hh.view(len(layer), 4, H, H).transpose(2, 3).contiguous()
                    prepared.append((w_ih, bias, w_hh, w_hh_t))
            self._prepared, self._prepared_key = prepared, key
        return self._prepared

    def _fallback(self, x_batch_first, hx, lengths):
        if not self._warned_fallback:
            warnings.warn(
                "PersistentLSTM: a gradient is needed, so this call runs the padded PyTorch stage "
                "(differentiable, but one small product per time step) instead of the Triton kernels, "
                "which are inference-only; use torch.no_grad() or torch.inference_mode() for inference",
                UserWarning,
                stacklevel=3,
            )
            self._warned_fallback = True
        return lstm_padded(x_batch_first, lstm_weights(self.lstm), lengths,
                           None if hx is None else hx[0], None if hx is None else hx[1])

    # -- checks ----------------------------------------------------------------------

    @staticmethod
    def _needs_autograd(x, hx, params) -> bool:
        if not torch.is_grad_enabled():
            return False
        tensors = [x, *params] + ([] if hx is None else list(hx))
        return any(t.requires_grad for t in tensors)

    def _check_data(self, name, x, params):
        lstm = self.lstm
        validation.check_float_tensor(name, x, dtypes=(torch.float32,))
        if x.shape[-1] != lstm.input_size:
            raise ValueError(
                f"{name} must have {lstm.input_size} features (the nn.LSTM's input_size) in its last "
                f"dimension; got shape {tuple(x.shape)}"
            )
        if x.device != params[0].device:
            raise ValueError(f"{name} must be on the device of the nn.LSTM's parameters ({params[0].device}); "
                             f"got {x.device}")
        needs_grad = self._needs_autograd(x, None, params)
        if not needs_grad:
            validation.check_kernel_device(name, x)

    def _check_state(self, hx, batch, x_name, x, unbatched):
        if hx is None:
            return None
        if not isinstance(hx, (tuple, list)) or len(hx) != 2:
            raise TypeError(f"hx must be a tuple (h0, c0), as for nn.LSTM; got {type(hx).__name__}")
        lstm = self.lstm
        expected = (lstm.num_layers * self.num_directions, lstm.hidden_size) if unbatched else (
            lstm.num_layers * self.num_directions, batch, lstm.hidden_size)
        checked = []
        for name, t in zip(("h0", "c0"), hx):
            validation.check_float_tensor(name, t, dtypes=(torch.float32,))
            if tuple(t.shape) != expected:
                raise ValueError(f"{name} must have shape {expected}; got {tuple(t.shape)}")
            validation.check_same_device(**{x_name: x, name: t})
            checked.append(t.unsqueeze(1) if unbatched else t)
        return tuple(checked)


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
    for name, p in lstm.named_parameters():
        if p.dtype != torch.float32:
            raise TypeError(f"the nn.LSTM's parameters must be float32; got {name} of dtype {p.dtype}")


def _check_lengths(lengths, batch, steps, device, traced) -> torch.Tensor:
    if not isinstance(lengths, torch.Tensor):
        lengths = torch.as_tensor(lengths)  # a list or an array of ints
    validation.check_index_tensor("lengths", lengths)
    if lengths.shape != (batch,):
        raise ValueError(f"lengths must have shape ({batch},) (one per sequence); got {tuple(lengths.shape)}")
    lengths = lengths.to(device=device, dtype=torch.int64)
    if batch and not traced:
        low, high = int(lengths.min()), int(lengths.max())
        if low < 0 or high > steps:
            raise ValueError(f"lengths must lie in [0, T={steps}]; got min {low}, max {high}")
    return lengths
