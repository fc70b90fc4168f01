"""No eager call stops the host: every public function, forward and backward, on CUDA
tensors, runs under ``torch.cuda.set_sync_debug_mode("error")`` without raising, and
queued behind a kernel that keeps the GPU busy for about a second returns at once (an
event wait is a synchronisation the debug mode does not see). GPU only."""
import time

import pytest
import torch

import packed_kernels as pk
from packed_kernels.bench.host import calls

pytestmark = pytest.mark.gpu_only

#: the references among the host benchmark's calls, not the package's own
_REFERENCES = ("index_add_ forward", "index_add (N, 3) fwd+bwd", "empty Triton launch")


def _segment_steps():
    """Forward and backward (first and second order) of each segment operation."""
    g = torch.Generator(device="cuda").manual_seed(0)
    S, N = 16, 480
    idx = torch.arange(S, device="cuda").repeat_interleave(N // S)

    def rand(*shape):
        return torch.randn(shape, device="cuda", generator=g, dtype=torch.float64).requires_grad_()

    x, y, per_segment, m = rand(N, 3), rand(N, 3), rand(S, 3), rand(S, 3, 3)
    ops = {
        "sum": (pk.segmented_sum, (x,)), "mean": (pk.segmented_mean, (x,)), "dot": (pk.segmented_dot, (x, y)),
        "mul": (pk.segmented_mul, (x, per_segment)), "rms_norm": (pk.segmented_rms_norm, (x,)),
        "matvec": (pk.segmented_matvec, (x, m)),
    }
    steps = {}
    for name, (fn, inputs) in ops.items():
        def step(fn=fn, inputs=inputs):
            out = fn(*inputs, idx, S)
            firsts = torch.autograd.grad(out.square().sum(), inputs, create_graph=True)
            return torch.autograd.grad(sum(f.square().sum() for f in firsts), inputs)
        steps[f"segmented_{name} second order"] = step
    return steps


def _steps():
    steps = {name: fn for name, (size, fn) in calls().items() if name not in _REFERENCES}
    steps.update(_segment_steps())
    return steps


@pytest.fixture(scope="module")
def steps():
    return _steps()


@pytest.mark.parametrize("name", sorted(_steps()) if torch.cuda.is_available() else [])
def test_eager_call_never_synchronises(name, steps):
    step = steps[name]
    step()  # compile the kernels first: a first launch may read device properties
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # about a second of GPU spin ahead of the call
    start = time.perf_counter()
    step()
    returned = time.perf_counter() - start
    torch.cuda.synchronize()
    assert returned < 0.25, f"{name} waited {returned:.3f} s for the GPU"
    pk.check_errors()


def test_a_violation_reaches_a_later_call_and_check_errors():
    """Default mode: the bad call returns, its violation is raised by the next call once
    the kernel has run, or by ``check_errors``; strict mode raises within the call."""
    idx = torch.tensor([0, 2, 1], device="cuda")
    x = torch.ones(3, device="cuda")
    pk.segmented_sum(x, idx, 3)  # returns: the check runs on the device
    torch.cuda.synchronize()
    with pytest.raises(ValueError, match="segmented_sum: idx must be sorted"):
        pk.segmented_sum(x, torch.tensor([0, 1, 2], device="cuda"), 3)
    pk.segmented_mean(x, idx, 3)
    with pytest.raises(ValueError, match="segmented_mean: idx must be sorted"):
        pk.check_errors()
    with pk.strict_checks(), pytest.raises(ValueError, match="segmented_dot: idx must be sorted"):
        pk.segmented_dot(x, x, idx, 3)
    pk.check_errors()


def test_a_captured_call_reports_on_replay():
    idx = torch.tensor([0, 1, 1], device="cuda")
    x = torch.ones(3, device="cuda")
    pk.segmented_sum(x, idx, 2)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = pk.segmented_sum(x, idx, 2)
    graph.replay()
    pk.check_errors()
    idx.copy_(torch.tensor([0, 5, 1], device="cuda"))
    graph.replay()
    with pytest.raises(ValueError, match=r"segmented_sum: idx must lie in \[0, num_segments\), which fails at row 1"):
        pk.check_errors()
    assert out.shape == (2,)


def test_ctc_takes_host_lengths_for_gpu_inputs_without_a_wait():
    """Target lengths as a list or a CPU tensor beside CUDA log-probabilities: the same loss
    as a CUDA tensor of lengths, and no synchronisation."""
    g = torch.Generator(device="cuda").manual_seed(3)
    log_probs = torch.randn(30, 6, device="cuda", generator=g).log_softmax(-1)
    cu_seqlens = pk.cu_seqlens_from_lengths(torch.tensor([12, 18], device="cuda"))
    targets = torch.randint(1, 6, (2, 4), device="cuda", generator=g)
    want = pk.packed_ctc_loss(log_probs, cu_seqlens, targets, torch.tensor([4, 3], device="cuda"), reduction="none")
    for lengths in ([4, 3], (4, 3), torch.tensor([4, 3]), torch.tensor([4, 3], dtype=torch.int32)):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = pk.packed_ctc_loss(log_probs, cu_seqlens, targets, lengths, reduction="none")
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    pk.check_errors()
