"""Benchmark cases of the Sinkhorn chapter: forward, each backward, and both together.

Sizes: 64K, 1M and 4M tokens at n = 4 (the mHC case), then n = 8, 16, 32 at the
bytes of 4M tokens at n = 4. Providers:

* ``triton``: the package's kernels (``triton_unrolled`` for the unrolled backward
  in ``fwd+bwd``); ``triton_tile``: the tile kernels where another layout is the
  default (one token per thread at n = 4 and 8, column groups in the forward at n = 16
  and 32 and in the implicit backward at n = 16), to show what that layout is worth;
* ``triton_teaching``: the chapter's teaching kernel (forward only, one matrix a
  program, log-space iterations), beside the production kernel at every size;
* ``torch_loop``: the padded PyTorch stage, autograd through the 20-iteration loop;
  ``torch_loop_compiled``: the same forward (and, in ``fwd+bwd``, autograd through the
  compiled loop) under ``torch.compile``, what a user who fuses the loop with the
  compiler gets (compiled afresh for each size, static shapes);
* ``triton_graph`` and ``torch_loop_graph`` (``fwd`` and ``fwd+bwd``): ``triton`` and
  ``torch_loop`` captured once into a CUDA graph and replayed, the GPU's time without the
  host's; in ``fwd+bwd`` the step is ``torch.autograd.grad`` of ``R`` with ``dR``;
* ``torch_cg``: the padded PyTorch implicit backward (batched conjugate gradient,
  ``2n`` steps);
* ``eps_cg_float32``: plain float32 conjugate gradient on ``[[I, R], [R^T, I]]`` with
  an epsilon in its denominators, the approach of published kernels (``2n`` steps).

Floor: each input read once and each output written once, in float32.
"""
from __future__ import annotations

from typing import Iterable

import torch

from .harness import Case, captured

ITERS = 20
_SIZES = [(4, 1 << 16), (4, 1 << 20), (4, 1 << 22), (8, 1 << 20), (16, 1 << 18), (32, 1 << 16)]


def _inputs(n: int, tokens: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(tokens, n, n, device="cuda", generator=g)
    grad = torch.randn(tokens, n, n, device="cuda", generator=g)
    return logits, grad


def _layout(provider):
    """The kernels' layout of a ``triton*`` provider: ``triton_tile`` forces the tile kernels."""
    from ..ops.sinkhorn.triton_kernels import Layout

    return Layout.TILE if provider == "triton_tile" else None


def _fwd_triton(provider, n, tokens):
    def factory():
        from ..ops.sinkhorn.teaching import sinkhorn_teaching
        from ..ops.sinkhorn.triton_kernels import forward_config, sinkhorn_forward_triton

        logits, _ = _inputs(n, tokens, 0)
        if provider == "triton_teaching":
            return lambda: sinkhorn_teaching(logits, ITERS)
        config = forward_config(n, logits.dtype, layout=_layout(provider))

        def step():
            return sinkhorn_forward_triton(logits, ITERS, config)
        return captured(step) if provider == "triton_graph" else step
    return factory


def _compiled_loop():
    """The padded PyTorch loop under ``torch.compile``, compiled afresh for the shapes it
    first sees (so that no size reuses, or runs out of, another size's compiled code)."""
    from ..ops.sinkhorn.padded_torch import sinkhorn_padded

    torch._dynamo.reset()
    return torch.compile(sinkhorn_padded, dynamic=False)


def _fwd_torch(provider, n, tokens):
    def factory():
        from ..ops.sinkhorn.padded_torch import sinkhorn_padded

        logits, _ = _inputs(n, tokens, 0)
        loop = _compiled_loop() if provider == "torch_loop_compiled" else sinkhorn_padded

        def step():
            return loop(logits, ITERS)
        return captured(step) if provider == "torch_loop_graph" else step
    return factory


def _implicit(provider, n, tokens):
    def factory():
        from ..ops.sinkhorn import padded_torch
        from ..ops.sinkhorn.triton_kernels import (
            forward_config,
            implicit_backward_config,
            sinkhorn_forward_triton,
            sinkhorn_implicit_backward_triton,
        )

        logits, grad = _inputs(n, tokens, 1)
        R = sinkhorn_forward_triton(logits, ITERS, forward_config(n, logits.dtype))
        del logits
        if provider in ("triton", "triton_tile"):
            config = implicit_backward_config(n, R.dtype, False, layout=_layout(provider))
            return lambda: sinkhorn_implicit_backward_triton(R, grad, None, config)
        if provider == "torch_cg":
            return lambda: padded_torch.implicit_backward_padded(R, grad)
        return lambda: padded_torch.implicit_backward_eps_cg_padded(R, grad)
    return factory


def _unrolled(provider, n, tokens):
    def factory():
        logits, grad = _inputs(n, tokens, 2)
        if provider in ("triton", "triton_tile"):
            from ..ops.sinkhorn.triton_kernels import sinkhorn_unrolled_backward_triton, unrolled_backward_config

            config = unrolled_backward_config(n, logits.dtype, ITERS, layout=_layout(provider))
            return lambda: sinkhorn_unrolled_backward_triton(logits, grad, ITERS, config)
        from ..ops.sinkhorn.padded_torch import sinkhorn_padded

        logits.requires_grad_()
        R = sinkhorn_padded(logits, ITERS)  # the graph (every iterate) is kept for repeated backwards
        return (lambda: R.backward(grad, retain_graph=True)), [logits]
    return factory


def _fwd_bwd(provider, n, tokens):
    def factory():
        from ..ops.sinkhorn import padded_torch
        from ..ops.sinkhorn.api import sinkhorn

        logits, grad = _inputs(n, tokens, 3)
        logits.requires_grad_()
        if provider == "triton":
            return (lambda: sinkhorn(logits, ITERS).backward(grad)), [logits]
        if provider == "triton_unrolled":
            return (lambda: sinkhorn(logits, ITERS, backward="unrolled").backward(grad)), [logits]
        if provider == "torch_loop":
            return (lambda: padded_torch.sinkhorn_padded(logits, ITERS).backward(grad)), [logits]
        if provider == "torch_loop_compiled":
            loop = _compiled_loop()
            return (lambda: loop(logits, ITERS).backward(grad)), [logits]
        if provider in ("triton_graph", "torch_loop_graph"):
            project = (lambda x: sinkhorn(x, ITERS)) if provider == "triton_graph" else (
                lambda x: padded_torch.sinkhorn_padded(x, ITERS))
            return captured(lambda: torch.autograd.grad(project(logits), logits, grad))

        def torch_cg():
            with torch.no_grad():
                R = padded_torch.sinkhorn_padded(logits, ITERS)
            logits.grad = padded_torch.implicit_backward_padded(R, grad)
        return torch_cg, [logits]
    return factory


def cases() -> Iterable[Case]:
    from ..ops.sinkhorn.triton_kernels import Layout, forward_config, implicit_backward_config, unrolled_backward_config

    def tile(config):
        """The tile provider wherever another layout is the kernel's default."""
        return ("triton_tile",) if config.layout is not Layout.TILE else ()

    for n, tokens in _SIZES:
        params = {"n": n, "tokens": tokens}
        matrix_bytes = tokens * n * n * 4
        notes = {"iters": ITERS, "bytes_per_token_fwd": 2 * n * n * 4}
        fwd_tile = tile(forward_config(n, torch.float32))
        implicit_tile = tile(implicit_backward_config(n, torch.float32, False))
        unrolled_tile = tile(unrolled_backward_config(n, torch.float32, ITERS))
        fwd = {p: _fwd_triton(p, n, tokens) for p in ("triton", *fwd_tile, "triton_teaching", "triton_graph")}
        fwd.update({p: _fwd_torch(p, n, tokens) for p in ("torch_loop", "torch_loop_compiled", "torch_loop_graph")})
        yield Case("fwd", params, fwd, floor_bytes=2 * matrix_bytes, notes=notes)
        yield Case("bwd_implicit", params,
                   {p: _implicit(p, n, tokens) for p in ("triton", *implicit_tile, "torch_cg", "eps_cg_float32")},
                   floor_bytes=3 * matrix_bytes, notes=notes)
        yield Case("bwd_unrolled", params, {p: _unrolled(p, n, tokens) for p in ("triton", *unrolled_tile, "torch_loop")},
                   floor_bytes=3 * matrix_bytes, notes=notes)
        yield Case("fwd+bwd", params,
                   {p: _fwd_bwd(p, n, tokens) for p in ("triton", "triton_unrolled", "triton_graph", "torch_loop",
                                                        "torch_loop_compiled", "torch_loop_graph", "torch_cg")},
                   floor_bytes=4 * matrix_bytes, notes=notes)
