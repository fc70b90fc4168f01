"""Shared inputs and independent references of the Sinkhorn tests.

References: the float64 NumPy stage (iterations, hand-written reverse mode, least
squares on the singular implicit system) and float64 autograd through the textbook
loop written out here (``exp(X - colmax X)``, then dividing by column and row sums).
"""
import numpy as np
import torch

from packed_kernels.ops.sinkhorn import naive_numpy

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


def textbook_loop(logits, iters):
    """``exp(logits - colmax)``, then ``iters`` times: divide by column sums, then by row sums."""
    E = torch.exp(logits - logits.amax(dim=-2, keepdim=True))
    for _ in range(iters):
        E = E / E.sum(dim=-2, keepdim=True)
        E = E / E.sum(dim=-1, keepdim=True)
    return E


def loop_reference(logits64, iters, grad64=None):
    """Forward and (optionally) unrolled gradient by autograd through the textbook loop
    in float64 (exact for logits within a few hundred of their column maxima).

    On one CPU thread: with several, the float64 gradient moves by up to 5e-10 from
    run to run (bit-identical with one).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x = logits64.detach().cpu().clone().requires_grad_(grad64 is not None)
        R = textbook_loop(x, iters)
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




#: the logits of the issue's examples: a row whose entries all lie about 95 below their
#: column maxima (n = 2) and two such rows (n = 3), at every n where they fit
NARROW_ROW_EXAMPLES = {2: [[-56.0, -41.0], [38.0, 54.0]], 3: [[-57.0, 68.0, 77.0], [14.0, -10.0, 43.0],
                                                               [-64.0, -75.0, -72.0]]}


def wide_logits(n: int, seed: int, count: int = 8) -> torch.Tensor:
    """float64 ``(T, n, n)`` logits spread over ``+-100``, the first ``count`` of: a uniform
    draw, a row far above the rest (every other row far below its column maxima), a
    near-permutation (peaks of 100 over entries in ``[-100, 0]``), two diagonal blocks
    linked only through entries ``e^-100`` below them, a row far below, a column far
    below, another uniform draw, and the example of :data:`NARROW_ROW_EXAMPLES` where
    ``n`` has one."""
    g = torch.Generator().manual_seed(seed)

    def uniform(low, high):
        return low + (high - low) * torch.rand((n, n), generator=g, dtype=torch.float64)

    row_above = uniform(-5, 5)
    row_above[0] += 95
    peaked = uniform(-100, 0)
    peaked[torch.arange(n), torch.randperm(n, generator=g)] = 100.0
    half = (n + 1) // 2
    blocks = uniform(-50, -45)
    blocks[:half, :half] += 95
    blocks[half:, half:] += 95
    row_below = uniform(-5, 5)
    row_below[-1] -= 95
    column_below = uniform(-5, 5)
    column_below[:, 0] -= 95
    cases = [uniform(-100, 100), row_above, peaked, blocks, row_below, column_below, uniform(-100, 100)]
    if n in NARROW_ROW_EXAMPLES:
        cases.append(torch.tensor(NARROW_ROW_EXAMPLES[n], dtype=torch.float64))
    return torch.stack(cases[:count])


def weighted_implicit_reference(R, grad_R) -> torch.Tensor:
    """The implicit gradient of each matrix by least squares in float64 NumPy on the
    weighted system ``[[diag(r), R], [R^T, diag(c)]] [alpha; beta] = [a; b]`` (``r, c``
    the row and column sums of ``R``, ``a, b`` those of ``R * grad_R``), then
    ``R * (grad_R - alpha_i - beta_j)``: the system of :func:`implicit_reference` for a
    doubly stochastic ``R``, and consistent for any ``R`` (a forward output after
    finitely many iterations, or rounded to a low-precision dtype)."""
    shape = R.shape
    R = R.detach().cpu().double().reshape(-1, *shape[-2:]).numpy()
    grad_R = grad_R.detach().cpu().double().reshape(R.shape).numpy()
    out = []
    for r, g in zip(R, grad_R):
        n = r.shape[0]
        system = np.block([[np.diag(r.sum(1)), r], [r.T, np.diag(r.sum(0))]])
        weighted = r * g
        solution, *_ = np.linalg.lstsq(system, np.concatenate([weighted.sum(1), weighted.sum(0)]), rcond=None)
        out.append(r * (g - solution[:n, None] - solution[None, n:]))
    return torch.from_numpy(np.stack(out)).reshape(shape) if out else torch.zeros(shape, dtype=torch.float64)
