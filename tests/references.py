"""Independent float64 references for the property tests, in plain PyTorch.

Each function here is written from the definitions (the maths in the package's
docstrings, the conventions of the PyTorch operations it mirrors), not from the
package's own stages (``naive_numpy``, ``padded_torch``): a bug shared by a stage and
its kernel cannot hide behind a reference that copies it. They compute in float64,
are differentiable by autograd (to second order where the operation is), and take
inputs of any strides. The notebooks can import them too; :func:`property_settings`
needs ``hypothesis``, the references do not.

Layouts: :func:`as_layout` returns a tensor of the same values as its argument with
other strides (transposed, sliced, expanded), differentiably, so that a test hands the
package a non-contiguous view of a leaf and compares gradients with respect to the leaf.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

# --- test settings -----------------------------------------------------------------------


def property_settings(max_examples: int):
    """The settings of every property test: derandomized (the same examples on every
    run, so a failure reproduces and the test's time is fixed), ``max_examples`` of
    them, no per-example deadline and no slowness health check (kernels run through
    Triton's interpreter take far longer than hypothesis expects of a test), no
    example database written to disk."""
    from hypothesis import HealthCheck, settings

    return settings(
        derandomize=True,
        max_examples=max_examples,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


# --- layouts -----------------------------------------------------------------------------

#: How :func:`as_layout` lays a tensor out in memory.
LAYOUTS = ("contiguous", "transposed", "sliced", "expanded")


def as_layout(x: Tensor, layout: str) -> Tensor:
    """``x`` with the strides that ``layout`` names, differentiable with respect to ``x``.

    * ``"contiguous"``: ``x`` itself.
    * ``"transposed"``: the same values, the last two dims stored transposed (column
      major); a 1-D ``x`` is ``"sliced"`` instead.
    * ``"sliced"``: the same values, every other element of a buffer twice as wide in
      the last dim (stride 2).
    * ``"expanded"``: row 0 of ``x`` repeated along dim 0 with stride 0 (``x[:1].expand``):
      the values change, so the reference must see the same view of the same leaf.
    """
    if layout == "contiguous" or x.numel() == 0:
        return x
    if layout == "transposed" and x.dim() >= 2:
        return x.transpose(-1, -2).contiguous().transpose(-1, -2)
    if layout in ("transposed", "sliced"):
        wide = torch.stack([x, torch.zeros_like(x)], dim=-1).flatten(-2)
        return wide[..., ::2]
    if layout == "expanded":
        return x[:1].expand(x.shape)
    raise ValueError(f"layout must be one of {LAYOUTS}; got {layout!r}")


def rounded(x: Tensor, dtype: torch.dtype) -> Tensor:
    """``x`` rounded to ``dtype`` and back to float64: the values a kernel given ``x.to(dtype)`` reads."""
    return x.to(dtype).to(torch.float64)


# --- CTC ---------------------------------------------------------------------------------

#: ``log 0`` as a finite number in the CTC recursion: ``logsumexp`` of states that are all
#: unreachable then has a finite gradient (0 weight on each, after the upstream zero),
#: where ``-inf`` would give NaN. Adding log-probabilities of ordinary size leaves it
#: unchanged in float64, so an impossible alignment ends near ``LOG_ZERO``.
LOG_ZERO = -1e30


def ctc_log_likelihood_padded(log_probs: Tensor, input_lengths: Tensor, targets: Tensor,
                              target_lengths: Tensor, blank: int) -> Tuple[Tensor, Tensor]:
    """Per-utterance ``log p(target | x)`` by the CTC forward (alpha) recursion, in log space.

    ``log_probs`` ``(B, T, C)`` float64 (frames at or beyond ``input_lengths[b]`` are
    ignored); ``targets`` ``(B, U)`` (entries at or beyond ``target_lengths[b]`` ignored).
    The extended label sequence of utterance ``b`` is ``l' = (blank, l_1, blank, l_2, ...,
    l_L, blank)``, ``2 L + 1`` states. From a virtual start before frame 0 (state 0 with
    log-weight 0), each frame ``t < T_b``::

        alpha_t(s) = logsumexp(alpha_{t-1}(s), alpha_{t-1}(s - 1), [alpha_{t-1}(s - 2)]) + lp_t(l'_s)

    where the skip from ``s - 2`` is allowed when ``s`` is a label state (odd) and
    ``l'_s != l'_{s-2}``. A target id equal to the blank stays a label state, as in
    ``torch.nn.functional.ctc_loss``: it emits the blank class, but it may be skipped
    to and from like any label. The likelihood is
    ``logsumexp(alpha_{T_b - 1}(2 L), alpha_{T_b - 1}(2 L - 1))``.

    Returns ``(log_likelihood, possible)``: ``(B,)`` float64, differentiable with respect
    to ``log_probs``, and whether an alignment exists (where not, the log-likelihood is
    a junk value near :data:`LOG_ZERO`).
    """
    B, T, C = log_probs.shape
    U = targets.shape[1]
    S = 2 * U + 1
    device = log_probs.device
    in_target = torch.arange(U, device=device)[None, :] < target_lengths[:, None]
    labels = torch.where(in_target, targets.to(torch.int64), blank)
    extended = torch.full((B, S), blank, dtype=torch.int64, device=device)
    extended[:, 1::2] = labels
    can_skip = torch.zeros((B, S), dtype=torch.bool, device=device)
    label_state = torch.arange(S, device=device) % 2 == 1
    can_skip[:, 2:] = label_state[2:] & (extended[:, 2:] != extended[:, :-2])
    emissions = log_probs.gather(2, extended[:, None, :].expand(B, T, S))  # (B, T, S)
    floor = torch.full((B, 1), LOG_ZERO, dtype=log_probs.dtype, device=device)
    alpha = torch.cat([torch.zeros_like(floor), floor.expand(B, S - 1)], dim=1)
    for t in range(T):
        stay = alpha
        step = torch.cat([floor, alpha[:, :-1]], dim=1)
        skip = torch.where(can_skip, torch.cat([floor, floor, alpha[:, :-2]], dim=1)[:, :S], LOG_ZERO)
        new = torch.logsumexp(torch.stack([stay, step, skip]), dim=0) + emissions[:, t]
        alpha = torch.where((t < input_lengths)[:, None], new, alpha)
    last = 2 * target_lengths.to(torch.int64)
    final_blank = alpha.gather(1, last[:, None])[:, 0]
    final_label = torch.where(last > 0, alpha.gather(1, (last - 1).clamp(min=0)[:, None])[:, 0], LOG_ZERO)
    log_likelihood = torch.logsumexp(torch.stack([final_blank, final_label]), dim=0)
    return log_likelihood, log_likelihood > LOG_ZERO / 2


def ctc_loss_reference(log_probs: Tensor, cu_seqlens: Tensor, targets: Tensor, target_lengths: Tensor, *,
                       blank: int, reduction: str, zero_infinity: bool,
                       grad_output: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """The CTC loss of a packed batch and its gradient in PyTorch's convention, float64.

    ``log_probs`` ``(T_total, C)``, utterance ``b`` rows ``cu_seqlens[b]:cu_seqlens[b+1]``,
    padded here to ``(B, T, C)`` for :func:`ctc_log_likelihood_padded`. Losses: ``nll_b =
    -log p`` (``inf`` if impossible; 0 there under ``zero_infinity``), reduced by
    ``"none"``, ``"sum"`` or ``"mean"`` (``mean_b nll_b / max(L_b, 1)``).

    The gradient with respect to ``log_probs``, for ``loss.backward(grad_output)``, with
    ``g_b = d loss / d nll_b`` (``grad_output`` defaults to ones of the loss's shape)::

        grad[t, c] = g_b (d nll_b / d lp[t, c] + exp(lp[t, c]))   for t a frame of b

    (the second term is the convention of ``torch.nn.functional.ctc_loss``: the result
    is the logits' gradient once passed through ``log_softmax``'s backward); NaN on the
    frames of an impossible utterance, 0 there under ``zero_infinity``.

    Returns ``(loss, grad)``: the loss detached, ``grad`` ``(T_total, C)`` float64.
    """
    log_probs = log_probs.detach().to(torch.float64).requires_grad_()
    cu = cu_seqlens.to(torch.int64).cpu()
    input_lengths = cu.diff()
    B = input_lengths.numel()
    T = int(input_lengths.max()) if B else 0
    frames = [(b, t) for b in range(B) for t in range(int(input_lengths[b]))]
    utterance_of_row = torch.tensor([b for b, _ in frames], dtype=torch.int64)
    frame_of_row = torch.tensor([t for _, t in frames], dtype=torch.int64)
    padded = log_probs.new_zeros((B, T, log_probs.shape[1])).index_put((utterance_of_row, frame_of_row), log_probs)
    lengths = target_lengths.to(torch.int64).cpu()
    log_likelihood, possible = ctc_log_likelihood_padded(padded, input_lengths, targets.cpu(), lengths, blank)
    nll = torch.where(possible, -log_likelihood, 0.0)  # a finite stand-in where impossible, for autograd
    nll_leaf = nll.detach().requires_grad_()
    shown = torch.where(possible, nll_leaf, 0.0 if zero_infinity else float("inf"))
    if reduction == "none":
        loss = shown
    elif reduction == "sum":
        loss = shown.sum()
    else:
        loss = (shown / lengths.clamp(min=1)).mean()
    if grad_output is None:
        grad_output = torch.ones_like(loss)
    grad_output = grad_output.to(torch.float64).cpu()
    (g,) = torch.autograd.grad(loss, nll_leaf, grad_output, allow_unused=True)
    g = torch.zeros(B, dtype=torch.float64) if g is None else g
    grad = None
    if nll.requires_grad:  # (a batch without frames has nothing to differentiate)
        (grad,) = torch.autograd.grad(nll, log_probs, g, allow_unused=True)
    grad = torch.zeros_like(log_probs) if grad is None else grad
    grad = grad + g[utterance_of_row, None] * log_probs.detach().exp()
    impossible_row = (~possible)[utterance_of_row, None].expand_as(grad)
    grad = torch.where(impossible_row, 0.0 if zero_infinity else float("nan"), grad)
    return loss.detach(), grad.detach()


# --- Sinkhorn ----------------------------------------------------------------------------


def sinkhorn_reference(logits: Tensor, iters: int) -> Tensor:
    """``R = exp(logits)``, then ``iters`` times: divide by the column sums (dim -2), then
    by the row sums (dim -1). Differentiable: autograd through the loop is the exact
    gradient of the ``iters``-step map. (The column maximum is subtracted first, which
    the first column normalisation undoes exactly.)"""
    R = (logits - logits.amax(dim=-2, keepdim=True)).exp()
    for _ in range(iters):
        R = R / R.sum(dim=-2, keepdim=True)
        R = R / R.sum(dim=-1, keepdim=True)
    return R


def sinkhorn_implicit_reference(R: Tensor, grad_R: Tensor) -> Tensor:
    """``dlogits = R * (grad_R - alpha[:, None] - beta[None, :])`` per matrix, float64.

    ``alpha, beta`` solve, by the pseudo-inverse (the system is singular along ``(1, -1)``,
    which leaves ``dlogits`` unchanged), the weighted system::

        [[diag(rowsum R), R], [R^T, diag(colsum R)]] [alpha; beta] = [rowsum(R * grad_R); colsum(R * grad_R)]

    which makes every row and column of ``dlogits`` sum to zero, and is the implicit
    function theorem's system ``[[I, R], [R^T, I]]`` when ``R`` is doubly stochastic.
    """
    R, grad_R = R.to(torch.float64), grad_R.to(torch.float64)
    n = R.shape[-1]
    flat_R, flat_grad = R.reshape(-1, n, n), grad_R.reshape(-1, n, n)
    out = torch.empty_like(flat_R)
    for k in range(flat_R.shape[0]):
        r, weighted = flat_R[k], flat_R[k] * flat_grad[k]
        system = torch.cat([torch.cat([torch.diag(r.sum(1)), r], 1), torch.cat([r.T, torch.diag(r.sum(0))], 1)])
        rhs = torch.cat([weighted.sum(1), weighted.sum(0)])
        solution = torch.linalg.pinv(system) @ rhs
        alpha, beta = solution[:n], solution[n:]
        out[k] = r * (flat_grad[k] - alpha[:, None] - beta[None, :])
    return out.reshape(R.shape)


# --- segment operations ------------------------------------------------------------------


def _segment_total(values: Tensor, idx: Tensor, num_segments: int) -> Tensor:
    out = values.new_zeros((num_segments,) + tuple(values.shape[1:]))
    return out.index_add(0, idx.to(torch.int64), values)


def _segment_counts(idx: Tensor, num_segments: int, dtype) -> Tensor:
    return torch.bincount(idx.to(torch.int64), minlength=num_segments).to(dtype)


def _row_totals(values: Tensor) -> Tensor:
    """The sum of each row's entries, ``(N,)`` (a 1-D ``values`` is its own)."""
    return values.flatten(1).sum(1) if values.dim() > 1 else values


def segmented_sum_reference(x: Tensor, idx: Tensor, num_segments: int) -> Tensor:
    """``out[s] = sum_{i: idx[i] = s} x[i]`` (0 for an empty segment)."""
    return _segment_total(x, idx, num_segments)


def segmented_mean_reference(x: Tensor, idx: Tensor, num_segments: int) -> Tensor:
    """``out[s] = sum_{i in s} x[i] / n_s`` (0 for an empty segment)."""
    counts = _segment_counts(idx, num_segments, x.dtype).clamp(min=1)
    return _segment_total(x, idx, num_segments) / counts.reshape((-1,) + (1,) * (x.dim() - 1))


def segmented_dot_reference(x: Tensor, y: Tensor, idx: Tensor, num_segments: int) -> Tensor:
    """``out[s] = sum_{i in s} <x[i], y[i]>``, ``(S,)``."""
    return _segment_total(_row_totals(x * y), idx, num_segments)


def segmented_mul_reference(x: Tensor, y: Tensor, idx: Tensor, num_segments: int) -> Tensor:
    """``out[i] = x[i] * y[idx[i]]``; a ``(S,)`` ``y`` with a 2-D ``x`` scales whole rows."""
    factors = y[idx.to(torch.int64)]
    if factors.dim() < x.dim():
        factors = factors.reshape(factors.shape + (1,) * (x.dim() - factors.dim()))
    return x * factors


def segmented_rms_norm_reference(x: Tensor, idx: Tensor, num_segments: int) -> Tensor:
    """``r[s] = sqrt(sum_{i in s} |x[i]|^2 / n_s)``; 0 with zero derivatives of every order
    where the sum is 0 (an empty segment or all-zero rows): the square root is taken of a
    stand-in 1 there, so its infinite derivative at 0 never enters autograd."""
    squares = _row_totals(x * x)
    mean_square = _segment_total(squares, idx, num_segments) / _segment_counts(idx, num_segments, x.dtype).clamp(min=1)
    positive = mean_square > 0
    return torch.where(positive, torch.where(positive, mean_square, 1.0).sqrt(), 0.0)


def segmented_matvec_reference(v: Tensor, m: Tensor, idx: Tensor, num_segments: int) -> Tensor:
    """``out[i, k] = sum_j m[idx[i], j, k] v[i, j]``."""
    return torch.einsum("ij,ijk->ik", v, m[idx.to(torch.int64)])


# --- LSTM --------------------------------------------------------------------------------


def lstm_module_weights(lstm: torch.nn.LSTM, layer: int, direction: int):
    """``(W_ih, W_hh, b_ih, b_hh)`` of one layer and direction of an ``nn.LSTM``, in float64
    (biases ``None`` without ``bias``), read by the module's own parameter names."""
    suffix = f"_l{layer}" + ("_reverse" if direction else "")
    weights = [getattr(lstm, f"{kind}{suffix}", None) for kind in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")]
    return tuple(None if w is None else w.to(torch.float64) for w in weights)


def lstm_cell_reference(x: Tensor, h: Tensor, c: Tensor, w_ih: Tensor, w_hh: Tensor,
                        b_ih: Optional[Tensor], b_hh: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    """One LSTM step (PyTorch's gate order: input, forget, cell, output)::

        [i, f, g, o] = W_ih x + b_ih + W_hh h + b_hh
        c' = sigmoid(f) c + sigmoid(i) tanh(g),   h' = sigmoid(o) tanh(c')
    """
    gates = w_ih @ x + w_hh @ h
    if b_ih is not None:
        gates = gates + b_ih + b_hh
    i, f, g, o = gates.chunk(4)
    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    return torch.sigmoid(o) * torch.tanh(c), c


def lstm_reference(lstm: torch.nn.LSTM, sequences: Sequence[Tensor], h0: Optional[Tensor] = None,
                   c0: Optional[Tensor] = None) -> Tuple[List[Tensor], Tensor, Tensor]:
    """A stacked (bidirectional) LSTM over sequences of their own lengths, one cell at a time.

    ``sequences[b]`` is ``(T_b, I)``; ``h0``, ``c0`` ``(num_layers D, B, H)`` or zeros. Per
    layer, the forward direction runs frames ``0 .. T_b - 1`` and the reverse direction
    ``T_b - 1 .. 0``, both from the initial state of their own index ``layer D + d``; the
    next layer reads both outputs side by side. A sequence of no frames leaves its state
    at the initial one. Returns ``(outputs, h_n, c_n)``: ``outputs[b]`` ``(T_b, D H)``
    float64, differentiable with respect to the sequences and the states.
    """
    D, H, B = 2 if lstm.bidirectional else 1, lstm.hidden_size, len(sequences)
    shape = (lstm.num_layers * D, B, H)
    h0 = torch.zeros(shape, dtype=torch.float64) if h0 is None else h0.to(torch.float64)
    c0 = torch.zeros(shape, dtype=torch.float64) if c0 is None else c0.to(torch.float64)
    layer_inputs = [s.to(torch.float64) for s in sequences]
    h_n = [[None] * B for _ in range(shape[0])]
    c_n = [[None] * B for _ in range(shape[0])]
    for layer in range(lstm.num_layers):
        outputs = []
        for b, x in enumerate(layer_inputs):
            per_direction = []
            for d in range(D):
                weights = lstm_module_weights(lstm, layer, d)
                state = layer * D + d
                h, c = h0[state, b], c0[state, b]
                frames = range(x.shape[0] - 1, -1, -1) if d else range(x.shape[0])
                out = [None] * x.shape[0]
                for t in frames:
                    h, c = lstm_cell_reference(x[t], h, c, *weights)
                    out[t] = h
                h_n[state][b], c_n[state][b] = h, c
                per_direction.append(torch.stack(out) if out else x.new_zeros((0, H)))
            outputs.append(torch.cat(per_direction, dim=1))
        layer_inputs = outputs
    if not B:
        return [], h0, c0
    return layer_inputs, torch.stack([torch.stack(r) for r in h_n]), torch.stack([torch.stack(r) for r in c_n])
