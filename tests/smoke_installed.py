"""A smoke test of every public function of an installed ``packed_kernels``.

Run outside the repository, in an environment where the package was installed from its
wheel (``.ci/wheel_smoke`` does this): it imports only the installed package, calls each
public function on small CPU inputs and compares with plain PyTorch.
"""
import torch
import torch.nn.functional as F

import packed_kernels as pk


def close(name, actual, expected, tol=1e-9):
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol, msg=lambda m: f"{name}: {m}")
    print(f"ok  {name}")


def main():
    assert "site-packages" in pk.__file__, f"not the installed package: {pk.__file__}"
    torch.manual_seed(0)
    f64 = torch.float64

    padded = torch.randn(3, 5, 2, dtype=f64)
    packed = pk.pack(padded, [5, 0, 3])
    close("pack/unpack", pk.unpack(packed)[2, :3], padded[2, :3])
    close("cu_seqlens_from_lengths", pk.cu_seqlens_from_lengths([5, 0, 3]), torch.tensor([0, 5, 5, 8], dtype=torch.int32))
    close("segment_ids_from_lengths", pk.segment_ids_from_lengths([2, 1]), torch.tensor([0, 0, 1], dtype=torch.int32))
    close("segment_ids_from_cu_seqlens", pk.segment_ids_from_cu_seqlens(torch.tensor([0, 1, 3])),
          torch.tensor([0, 1, 1], dtype=torch.int32))
    close("Packed.to_packed_sequence", pk.Packed.from_packed_sequence(pk.pack(padded, [5, 2, 3]).to_packed_sequence()).data,
          pk.pack(padded, [5, 2, 3]).data)

    lengths = torch.tensor([6, 4])
    logits = torch.randn(10, 5, dtype=f64, requires_grad=True)
    targets = torch.tensor([[1, 2, 2], [3, 0, 0]])
    target_lengths = torch.tensor([3, 1])
    loss = pk.packed_ctc_loss(logits.log_softmax(-1), pk.cu_seqlens_from_lengths(lengths), targets, target_lengths)
    (grad,) = torch.autograd.grad(loss, logits)
    log_probs_padded = pk.unpack(pk.Packed(logits.log_softmax(-1), pk.cu_seqlens_from_lengths(lengths), lengths))
    reference = F.ctc_loss(log_probs_padded.transpose(0, 1), targets, lengths, target_lengths)
    (reference_grad,) = torch.autograd.grad(reference, logits)
    close("packed_ctc_loss", loss, reference)
    close("packed_ctc_loss gradient", grad, reference_grad)

    matrices = torch.randn(4, 3, 3, dtype=f64, requires_grad=True)
    R = pk.sinkhorn(matrices, 200)
    close("sinkhorn rows", R.sum(-1), torch.ones(4, 3, dtype=f64))
    close("sinkhorn columns", R.sum(-2), torch.ones(4, 3, dtype=f64), tol=1e-6)
    grad_R = torch.randn_like(R)
    (implicit,) = torch.autograd.grad(R, matrices, grad_R)
    close("sinkhorn_backward", pk.sinkhorn_backward(R.detach(), grad_R), implicit)

    idx = torch.tensor([0, 0, 2, 2, 2], dtype=torch.int32)
    x = torch.randn(5, 3, dtype=f64)
    y = torch.randn(5, 3, dtype=f64)
    sums = torch.zeros(3, 3, dtype=f64).index_add_(0, idx.long(), x)
    counts = torch.tensor([2.0, 1.0, 3.0], dtype=f64)
    counts[1] = 0
    close("segmented_sum", pk.segmented_sum(x, idx, 3), sums)
    close("segmented_mean", pk.segmented_mean(x, idx, 3), sums / counts.clamp(min=1)[:, None])
    close("segmented_dot", pk.segmented_dot(x, y, idx, 3),
          torch.zeros(3, dtype=f64).index_add_(0, idx.long(), (x * y).sum(-1)))
    scale = torch.randn(3, 3, dtype=f64)
    close("segmented_mul", pk.segmented_mul(x, scale, idx, 3), x * scale[idx.long()])
    squares = torch.zeros(3, dtype=f64).index_add_(0, idx.long(), x.square().sum(-1))
    close("segmented_rms_norm", pk.segmented_rms_norm(x, idx, 3), (squares / counts.clamp(min=1)).sqrt())
    m = torch.randn(3, 3, 3, dtype=f64)
    close("segmented_matvec", pk.segmented_matvec(x, m, idx, 3), torch.einsum("njk,nj->nk", m[idx.long()], x))

    lstm = torch.nn.LSTM(4, 8, num_layers=2, bidirectional=True, batch_first=True).eval()
    fast = pk.PersistentLSTM.from_torch(lstm)
    inputs = torch.randn(2, 5, 4)
    with torch.no_grad():
        close("PersistentLSTM", fast(inputs)[0], lstm(inputs)[0], tol=1e-5)
    print("every public function works from the installed wheel")


if __name__ == "__main__":
    main()
