import pytest
import torch

from packed_kernels import Packed, pack, unpack


def _padded_batch(lengths, trailing, generator):
    T = max(lengths, default=0)
    return torch.randn((len(lengths), T) + trailing, generator=generator)


@pytest.mark.parametrize("trailing", [(), (3,), (2, 5)], ids=lambda t: "feat" + "x".join(map(str, t)) if t else "scalar")
@pytest.mark.parametrize(
    "lengths",
    [[5], [1, 1, 1], [0, 4, 0, 2], [7, 1, 3, 0], [1]],
    ids=lambda l: "L" + "-".join(map(str, l)),
)
def test_pack_roundtrip_and_layout(lengths, trailing):
    g = torch.Generator().manual_seed(sum(lengths) * 31 + len(trailing))
    padded = _padded_batch(lengths, trailing, g)
    packed = pack(padded, lengths)
    assert isinstance(packed, Packed)
    assert packed.data.shape == (sum(lengths),) + trailing
    assert packed.cu_seqlens.dtype == torch.int32 and packed.cu_seqlens.tolist()[0] == 0
    assert packed.lengths.tolist() == lengths
    for b, n in enumerate(lengths):
        start, end = packed.cu_seqlens[b].item(), packed.cu_seqlens[b + 1].item()
        assert end - start == n
        assert torch.equal(packed.data[start:end], padded[b, :n])
    restored = unpack(packed)
    mask = torch.arange(padded.shape[1])[None, :] < torch.tensor(lengths)[:, None]
    assert torch.equal(restored[mask], padded[mask])
    assert bool((restored[~mask] == 0).all())


def test_unpack_total_length_and_padding_value():
    packed = pack(torch.arange(12.0).reshape(2, 6), [2, 4])
    out = unpack(packed, total_length=8, padding_value=-1.0)
    assert out.shape == (2, 8)
    assert out[0].tolist() == [0, 1, -1, -1, -1, -1, -1, -1]
    assert out[1].tolist() == [6, 7, 8, 9, -1, -1, -1, -1]
    with pytest.raises(ValueError, match="total_length"):
        unpack(packed, total_length=3)


def test_empty_batch_and_all_empty_sequences():
    packed = pack(torch.zeros(3, 4, 2), [0, 0, 0])
    assert packed.data.shape == (0, 2) and packed.cu_seqlens.tolist() == [0, 0, 0, 0]
    assert unpack(packed).shape == (3, 0, 2)


def test_pack_bad_input():
    x = torch.zeros(2, 5)
    with pytest.raises(ValueError, match="lengths"):
        pack(x, [1, 2, 3])
    with pytest.raises(ValueError, match=r"lengths must lie in \[0, T=5\]"):
        pack(x, [6, 1])
    with pytest.raises(ValueError, match="lengths"):
        pack(x, [-1, 1])
    with pytest.raises(TypeError, match="lengths"):
        pack(x, torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="padded"):
        pack(torch.zeros(5), [5])
    with pytest.raises(TypeError, match="packed"):
        unpack(x)
