"""The shared argument checks: each refuses with the exception and the argument name its
contract gives, and lets good values through. Integer arguments (iters, cg_iters,
num_segments, blank): Python and NumPy integers are accepted and give the same result;
bools, floats and tensors are refused."""
import re

import numpy as np
import pytest
import torch

import packed_kernels as pk
from packed_kernels.validation import (
    check_bool, check_choice, check_float_tensor, check_index_tensor, check_rank, check_same_device, check_tensor,
    integer_argument,
)


def test_integer_argument():
    assert integer_argument("k", 3) == 3 and type(integer_argument("k", np.int64(3))) is int
    assert integer_argument("k", np.uint8(7)) == 7
    for bad in (True, 2.0, torch.tensor(2), "2", None):
        with pytest.raises(TypeError, match="k must be an int"):
            integer_argument("k", bad)


def test_numpy_integers_in_the_public_functions(device):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 4, 4, generator=g).to(device)
    assert torch.equal(pk.sinkhorn(logits, iters=np.int32(7)), pk.sinkhorn(logits, iters=7))
    R = pk.sinkhorn(logits, iters=30)
    grad = torch.randn(3, 4, 4, generator=g).to(device)
    assert torch.equal(pk.sinkhorn_backward(R, grad, cg_iters=np.int64(5)), pk.sinkhorn_backward(R, grad, cg_iters=5))
    with pytest.raises(TypeError, match="iters must be an int"):
        pk.sinkhorn(logits, iters=torch.tensor(7))

    idx = torch.tensor([0, 0, 1, 3], dtype=torch.int32, device=device)
    x = torch.randn(4, 3, generator=g).to(device)
    assert torch.equal(pk.segmented_sum(x, idx, np.int64(5)), pk.segmented_sum(x, idx, 5))
    assert torch.equal(pk.segmented_mean(x, idx, np.int16(4)), pk.segmented_mean(x, idx, 4))
    with pytest.raises(TypeError, match="num_segments must be a Python int"):
        pk.segmented_sum(x, idx, torch.tensor(5))

    lengths = torch.tensor([5, 3])
    log_probs = torch.randn(8, 4, generator=g, dtype=torch.float64).log_softmax(-1).to(device)
    cu = pk.cu_seqlens_from_lengths(lengths).to(device)
    targets = torch.tensor([[1, 2], [3, 0]], device=device)
    target_lengths = torch.tensor([2, 1], device=device)
    want = pk.packed_ctc_loss(log_probs, cu, targets, target_lengths, blank=0, reduction="none")
    got = pk.packed_ctc_loss(log_probs, cu, targets, target_lengths, blank=np.int64(0), reduction="none")
    assert torch.equal(got, want)
    with pytest.raises(TypeError, match="blank must be an int"):
        pk.packed_ctc_loss(log_probs, cu, targets, target_lengths, blank=0.0)


_F = torch.zeros(2, 3)

#: (id, call, exception, the message as a pattern: the argument name first)
CHECKS_BAD = [
    ("bool-int", lambda: check_bool("flag", 1), TypeError, "flag must be a bool; got int"),
    ("bool-none", lambda: check_bool("flag", None), TypeError, "flag must be a bool; got NoneType"),
    ("choice", lambda: check_choice("mode", "max", ("sum", "mean")), ValueError,
     "mode must be one of ('sum', 'mean'); got 'max'"),
    ("choice-none", lambda: check_choice("mode", None, ("sum",)), ValueError, "mode must be one of"),
    ("tensor-list", lambda: check_tensor("x", [1.0]), TypeError, "x must be a torch.Tensor; got list"),
    ("rank", lambda: check_rank("x", _F, 3), ValueError, "x must be 3-D; got shape (2, 3)"),
    ("rank-lower", lambda: check_rank("x", _F, (3, 4), "(B, T, C)"), ValueError,
     "x must be 3-D or 4-D (B, T, C); got shape (2, 3)"),
    ("rank-higher", lambda: check_rank("x", _F[None], 2), ValueError, "x must be 2-D; got shape (1, 2, 3)"),
    ("float-int", lambda: check_float_tensor("x", _F.long()), TypeError,
     "x must be float16, bfloat16, float32 or float64; got torch.int64"),
    ("float-only-32", lambda: check_float_tensor("x", _F.double(), dtypes=(torch.float32,)), TypeError,
     "x must be float32; got torch.float64"),
    ("float-rank", lambda: check_float_tensor("x", _F, dims=1), ValueError, "x must be 1-D"),
    ("index-float", lambda: check_index_tensor("idx", _F), TypeError, "idx must be int32 or int64; got torch.float32"),
    ("index-int16", lambda: check_index_tensor("idx", _F.short()), TypeError, "idx must be int32 or int64"),
    ("same-device-second", lambda: check_same_device(a=_F, b=_F.to("meta"), c=_F), ValueError,
     "b must be on a's device (cpu); got meta"),
    ("same-device-third", lambda: check_same_device(a=_F, b=_F, c=_F.to("meta")), ValueError,
     "c must be on a's device (cpu); got meta"),
    ("integer-float", lambda: integer_argument("k", 2.0, "a count"), TypeError, "k must be a count; got float"),
]


@pytest.mark.parametrize("call,error,message", [row[1:] for row in CHECKS_BAD], ids=[row[0] for row in CHECKS_BAD])
def test_checks_refuse_naming_the_argument(call, error, message):
    with pytest.raises(error, match=re.escape(message)):
        call()


def test_checks_let_good_values_through():
    assert check_bool("flag", False) is False and check_choice("mode", "sum", ("sum", "mean")) == "sum"
    assert check_tensor("x", _F) is _F and check_float_tensor("x", _F, dims=(1, 2)) is _F
    ints = _F.int()
    assert check_index_tensor("idx", ints, 2) is ints and check_index_tensor("idx", _F.long()).dtype == torch.int64
    check_rank("x", _F, (2, 3))
    check_same_device(a=_F, b=_F.long(), c=ints)  # dtypes may differ


# --- values checked on the device: the one policy ------------------------------------------------

def test_a_reported_violation_is_raised_once_by_the_next_check():
    from packed_kernels import validation

    check = validation.value_check("some_function", "idx", "must be sorted", "row")
    assert validation.value_check("some_function", "idx", "must be sorted", "row") is check
    other = validation.value_check("some_function", "idx", "must lie in [0, S)", "row")
    assert other.code != check.code and check.code > 0
    word = validation.error_word(torch.device("cpu"))
    word[0] = (check.code << validation.POSITION_BITS) | 41
    with pytest.raises(ValueError, match=re.escape("some_function: idx must be sorted, which fails at row 41")):
        validation.raise_reported()
    validation.raise_reported()  # forgotten once raised
    word[0] = (10 ** 6 << validation.POSITION_BITS) | 3
    with pytest.raises(ValueError, match="unknown violation"):
        pk.check_errors()
    pk.check_errors()


def test_report_flags_reports_the_first_flag_set():
    from packed_kernels import validation

    check = validation.value_check("some_function", "lengths", "must be >= 0", "sequence")
    validation.report_flags(check, torch.tensor([False, False, False]))
    pk.check_errors()
    flags = torch.zeros(3000, dtype=torch.bool)
    flags[[1700, 2900]] = True  # in the second block of 1024 and the third
    validation.report_flags(check, flags)
    with pytest.raises(ValueError, match="lengths must be >= 0, which fails at sequence (1700|2900)"):
        pk.check_errors()
    validation.report_flags(check, torch.tensor([0, 5, 0], dtype=torch.int32))
    with pytest.raises(ValueError, match="fails at sequence 1$"):
        pk.check_errors()


def test_strict_mode_switches_and_restores():
    from packed_kernels import validation

    assert pk.set_strict_checks(True) is False
    try:
        with pk.strict_checks(False):
            assert validation._STRICT[0] is False
        assert validation._STRICT[0] is True
    finally:
        assert pk.set_strict_checks(False) is True
    with pytest.raises(TypeError, match="enabled must be a bool"):
        pk.set_strict_checks(1)
