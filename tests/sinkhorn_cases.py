"""Shared inputs and independent references of the Sinkhorn tests.

References: the float64 NumPy stage (iterations, hand-written reverse mode, least
squares on the singular implicit system) and autograd through the PyTorch loop.
"""
import torch

from packed_kernels.ops.sinkhorn import naive_numpy, padded_torch

#: n of the tests that sweep sizes: the token-per-thread kernels (2, 4, 8), odd tiles,
#: the largest kernel size
NS = [1, 2, 3, 4, 5, 8, 16, 32]


def tokens_for(n: int) -> int:
    """Matrices per test input: fewer as ``n`` grows, to keep the interpreter fast."""
    return {1: 37, 2: 37, 3: 37, 4: 70, 5: 29, 8: 13, 16: 5, 32: 3}[n]


def random_logits(shape, scale, seed, dtype=torch.float64) -> torch.Tensor:
    """Gaussian logits of standard deviation ``scale`` (float64 draws, rounded to ``dtype``)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype)


def loop_reference(logits64, iters, grad64=None):
    """Forward and (optionally) unrolled gradient by autograd through the float64 loop.

    On one CPU thread: with several, the float64 gradient moves by up to 5e-10 from
    run to run (bit-identical with one).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x = logits64.detach().cpu().clone().requires_grad_(grad64 is not None)
        R = padded_torch.sinkhorn_padded(x, iters)
        if grad64 is None:
            return R.detach(), None
        R.backward(grad64.cpu())
        return R.detach(), x.grad
    finally:
        torch.set_num_threads(threads)


def implicit_reference(R, grad_R) -> torch.Tensor:
    """The implicit gradient of each matrix by least squares in float64 NumPy."""
    R = R.detach().cpu().double().reshape(-1, *R.shape[-2:])
    grad_R = grad_R.detach().cpu().double().reshape(R.shape)
    per_matrix = [torch.from_numpy(naive_numpy.implicit_backward_numpy(r.numpy(), g.numpy()))
                  for r, g in zip(R, grad_R)]
    return torch.stack(per_matrix) if per_matrix else torch.zeros_like(R)


def birkhoff(n, tokens, seed, peak=1.0) -> torch.Tensor:
    """Exactly doubly stochastic matrices (up to rounding): mixtures of permutations."""
    g = torch.Generator().manual_seed(seed)
    out = torch.zeros(tokens, n, n, dtype=torch.float64)
    for t in range(tokens):
        weights = torch.rand(n + 1, generator=g, dtype=torch.float64) ** (1 + peak * 8)
        weights = weights / weights.sum()
        for w in weights:
            perm = torch.randperm(n, generator=g)
            out[t, torch.arange(n), perm] += w
    return out


def shape_id(shape) -> str:
    return "x".join(map(str, shape))


