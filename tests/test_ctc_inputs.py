"""``packed_ctc_loss``: the arguments it refuses, in one table; each row spoils one argument
of a good call and names the exception, the argument its message must name and words the
message must contain.

Shapes, dtypes, devices and options are refused on the host, within the call. The values
of ``cu_seqlens``, ``target_lengths`` and ``targets`` are checked on the device, by the
forward's label sort: their messages start with the function's name, and each such row
runs in strict mode (raised within the call) and in the default mode (raised no later
than ``pk.check_errors()``).

Rows marked *silent if unchecked* are values that would give a result without an error if
they reached the kernels: the kernels clamp every index they read (see
``test_trusted_values.py``), and an int64 value beyond int32 wraps there.
"""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch

import packed_kernels as pk
from packed_kernels.ops.ctc.naive_numpy import ctc_loss_numpy
from tests.assertions import assert_close


def good_arguments(device):
    """Two utterances of 4 and 3 frames, 5 classes, targets padded to U = 3 (junk beyond)."""
    g = torch.Generator().manual_seed(59)
    log_probs = torch.randn(7, 5, generator=g).log_softmax(-1).to(device)
    return dict(log_probs=log_probs, cu_seqlens=torch.tensor([0, 4, 7], dtype=torch.int32, device=device),
                targets=torch.tensor([[1, 2, -9], [4, 9, 9]], device=device),
                target_lengths=torch.tensor([2, 1], device=device))


def _other_device(device):
    return "meta" if device == "cpu" else "cpu"


def _set(name, make):
    """A change that replaces argument ``name`` by ``make(arguments, device)``."""
    return lambda a, d: dict(a, **{name: make(a, d)})


def _tensor(values, dtype=torch.int64):
    return lambda a, d: torch.tensor(values, dtype=dtype, device=d)


def _first_target(value):
    def make(a, d):
        targets = a["targets"].clone()
        targets[0, 0] = value
        return targets
    return make


BAD_INPUTS = {
    # name: (change to the good arguments, error type, argument the message names, words it contains)
    # log_probs
    "log_probs-list": (_set("log_probs", lambda a, d: a["log_probs"].tolist()), TypeError, "log_probs",
                       "must be a torch.Tensor"),
    "log_probs-int": (_set("log_probs", lambda a, d: a["log_probs"].long()), TypeError, "log_probs",
                      "must be float16, bfloat16, float32 or float64; got torch.int64"),
    "log_probs-bool": (_set("log_probs", lambda a, d: a["log_probs"] > 0), TypeError, "log_probs", "got torch.bool"),
    "log_probs-1d": (_set("log_probs", lambda a, d: a["log_probs"][:, 0]), ValueError, "log_probs",
                     "must be 2-D (T_total, C)"),
    "log_probs-3d": (_set("log_probs", lambda a, d: a["log_probs"][None]), ValueError, "log_probs", "must be 2-D"),
    "log_probs-no-classes": (_set("log_probs", lambda a, d: a["log_probs"][:, :0]), ValueError, "log_probs",
                             "must have at least one class"),
    # cu_seqlens
    "cu_seqlens-list": (_set("cu_seqlens", lambda a, d: [0, 4, 7]), TypeError, "cu_seqlens", "must be a torch.Tensor"),
    "cu_seqlens-float": (_set("cu_seqlens", lambda a, d: a["cu_seqlens"].float()), TypeError, "cu_seqlens",
                         "must be int32 or int64; got torch.float32"),
    "cu_seqlens-int16": (_set("cu_seqlens", lambda a, d: a["cu_seqlens"].short()), TypeError, "cu_seqlens",
                         "got torch.int16"),
    "cu_seqlens-2d": (_set("cu_seqlens", lambda a, d: a["cu_seqlens"][None]), ValueError, "cu_seqlens",
                      "must be 1-D (B + 1,)"),
    "cu_seqlens-empty": (_set("cu_seqlens", lambda a, d: a["cu_seqlens"][:0]), ValueError, "cu_seqlens",
                         "must have B + 1 >= 1 entries"),
    # values checked on the device: the message names the function first
    "cu_seqlens-not-from-0": (_set("cu_seqlens", _tensor([1, 4, 7])), ValueError, "cu_seqlens",
                              "packed_ctc_loss: cu_seqlens must start at 0, which fails at entry 0"),
    # silent if unchecked: the kernels clamp a negative start to 0
    "cu_seqlens-negative-start": (_set("cu_seqlens", _tensor([-1, 4, 7])), ValueError, "cu_seqlens",
                                  "packed_ctc_loss: cu_seqlens must start at 0, which fails at entry 0"),
    # (the last step, and the only violation: cu_seqlens[1] = 8 is beyond T_total, which
    # only the end is checked against)
    "cu_seqlens-decreasing": (_set("cu_seqlens", _tensor([0, 8, 7], torch.int32)), ValueError, "cu_seqlens",
                              "packed_ctc_loss: cu_seqlens must be non-decreasing, which fails at entry 2"),
    "cu_seqlens-decreasing-first-step": (_set("cu_seqlens", _tensor([0, -2, 7])), ValueError, "cu_seqlens",
                                         "packed_ctc_loss: cu_seqlens must be non-decreasing, which fails at entry 1"),
    "cu_seqlens-short-of-T_total": (_set("cu_seqlens", _tensor([0, 4, 6], torch.int32)), ValueError, "cu_seqlens",
                                    "packed_ctc_loss: cu_seqlens must end at T_total = log_probs.shape[0], "
                                    "which fails at entry 2"),
    # silent if unchecked: the kernels clamp each end to T_total
    "cu_seqlens-beyond-T_total": (_set("cu_seqlens", _tensor([0, 4, 9])), ValueError, "cu_seqlens",
                                  "packed_ctc_loss: cu_seqlens must end at T_total"),
    # silent if unchecked: 2**32 + 7 is 7 in int32
    "cu_seqlens-int64-wraps-to-T_total": (_set("cu_seqlens", _tensor([0, 4, 2 ** 32 + 7])), ValueError, "cu_seqlens",
                                          "packed_ctc_loss: cu_seqlens must end at T_total = log_probs.shape[0], "
                                          "which fails at entry 2"),
    "cu_seqlens-other-device": (_set("cu_seqlens", lambda a, d: a["cu_seqlens"].to(_other_device(d))), ValueError,
                                "cu_seqlens", "must be on log_probs's device"),
    # targets
    "targets-list": (_set("targets", lambda a, d: a["targets"].tolist()), TypeError, "targets",
                     "must be a torch.Tensor"),
    "targets-float": (_set("targets", lambda a, d: a["targets"].float()), TypeError, "targets",
                      "must be int32 or int64; got torch.float32"),
    "targets-uint8": (_set("targets", lambda a, d: a["targets"].clamp(0).to(torch.uint8)), TypeError, "targets",
                      "got torch.uint8"),
    "targets-3d": (_set("targets", lambda a, d: a["targets"][None]), ValueError, "targets",
                   "must be 2-D (B, U) padded or 1-D (sum(target_lengths),) concatenated"),
    "targets-0d": (_set("targets", lambda a, d: a["targets"][0, 0]), ValueError, "targets", "must be 2-D"),
    # 1-D concatenated targets: [1, 2] and [-9], the padded row's junk now inside a target
    "targets-1d-id-outside": (_set("targets", lambda a, d: a["targets"][0]), ValueError, "targets",
                              "packed_ctc_loss: targets must lie in [0, C) within each target length, "
                              "which fails at utterance 1"),
    "targets-1d-lengths-sum-short": (_set("targets", _tensor([1, 2, 4, 3])), ValueError, "target_lengths",
                                     "packed_ctc_loss: target_lengths must be non-negative and sum to "
                                     "targets.shape[0] (1-D targets), which fails at utterance 1"),
    # silent if unchecked: the utterances would read [1, 2, 4] and []
    "targets-1d-lengths-negative": (lambda a, d: dict(a, targets=torch.tensor([1, 2, 4], device=d),
                                                      target_lengths=torch.tensor([3, -1], device=d)),
                                    ValueError, "target_lengths",
                                    "packed_ctc_loss: target_lengths must be non-negative and sum to "
                                    "targets.shape[0] (1-D targets), which fails at utterance 1"),
    "targets-1d-list-lengths-sum-long": (lambda a, d: dict(a, targets=torch.tensor([1, 2], device=d),
                                                           target_lengths=[2, 1]),
                                         ValueError, "target_lengths",
                                         "packed_ctc_loss: target_lengths must be non-negative and sum to "
                                         "targets.shape[0] (1-D targets), which fails at utterance 1"),
    "targets-1d-no-utterances": (lambda a, d: dict(a, cu_seqlens=torch.tensor([0], device=d),
                                                   log_probs=a["log_probs"][:0], targets=a["targets"][0],
                                                   target_lengths=a["target_lengths"][:0]),
                                 ValueError, "targets", "must be empty for B = 0 utterances"),
    "targets-wrong-batch": (_set("targets", lambda a, d: a["targets"][:1]), ValueError, "targets",
                            "must have shape (B=2, U) to match cu_seqlens"),
    "cu_seqlens-one-utterance-more": (_set("cu_seqlens", _tensor([0, 4, 7, 7])), ValueError, "targets",
                                      "must have shape (B=3, U)"),
    "targets-negative-id": (_set("targets", _first_target(-1)), ValueError, "targets",
                            "packed_ctc_loss: targets must lie in [0, C) within each target length, "
                            "which fails at utterance 0"),
    "targets-id-too-large": (_set("targets", _first_target(5)), ValueError, "targets",
                             "packed_ctc_loss: targets must lie in [0, C) within each target length, "
                             "which fails at utterance 0"),
    "targets-id-too-large-in-last-utterance": (_set("targets", _tensor([[1, 2, -9], [5, 9, 9]])), ValueError,
                                               "targets", "packed_ctc_loss: targets must lie in [0, C) within "
                                               "each target length, which fails at utterance 1"),
    # silent if unchecked: 2**32 + 1 is 1 in int32
    "targets-int64-wraps-to-a-class": (_set("targets", _first_target(2 ** 32 + 1)), ValueError, "targets",
                                       "packed_ctc_loss: targets must lie in [0, C)"),
    "targets-other-device": (_set("targets", lambda a, d: a["targets"].to(_other_device(d))), ValueError, "targets",
                             "must be on log_probs's device"),
    # target_lengths
    # a list of ints is taken (host data: checked at once)
    "target_lengths-string": (_set("target_lengths", lambda a, d: "21"), TypeError, "target_lengths",
                              "must be a torch.Tensor or a list of ints; got str"),
    "target_lengths-list-of-floats": (_set("target_lengths", lambda a, d: [2, 1.0]), TypeError, "target_lengths",
                                      "must be a torch.Tensor or a list of ints; got float at index 1"),
    "target_lengths-list-too-long": (_set("target_lengths", lambda a, d: (4, 1)), ValueError, "target_lengths",
                                     "packed_ctc_loss: target_lengths must lie in [0, U = targets.shape[1]], "
                                     "which fails at utterance 0"),
    "target_lengths-list-wrong-batch": (_set("target_lengths", lambda a, d: [2]), ValueError, "target_lengths",
                                        "must have shape (B=2,) to match cu_seqlens"),
    "target_lengths-float": (_set("target_lengths", lambda a, d: a["target_lengths"].float()), TypeError,
                             "target_lengths", "must be int32 or int64; got torch.float32"),
    "target_lengths-bool": (_set("target_lengths", lambda a, d: a["target_lengths"] > 0), TypeError,
                            "target_lengths", "got torch.bool"),
    "target_lengths-2d": (_set("target_lengths", lambda a, d: a["target_lengths"][None]), ValueError,
                          "target_lengths", "must be 1-D (B,)"),
    "target_lengths-wrong-batch": (_set("target_lengths", lambda a, d: a["target_lengths"][:1]), ValueError,
                                   "target_lengths", "must have shape (B=2,) to match cu_seqlens"),
    # silent if unchecked: the kernels clamp lengths to [0, U]
    "target_lengths-negative": (_set("target_lengths", _tensor([2, -1])), ValueError, "target_lengths",
                                "packed_ctc_loss: target_lengths must lie in [0, U = targets.shape[1]], "
                                "which fails at utterance 1"),
    "target_lengths-too-long": (_set("target_lengths", _tensor([4, 1])), ValueError, "target_lengths",
                                "packed_ctc_loss: target_lengths must lie in [0, U = targets.shape[1]], "
                                "which fails at utterance 0"),
    "target_lengths-int64-wraps-to-1": (_set("target_lengths", _tensor([2, 2 ** 32 + 1])), ValueError,
                                        "target_lengths", "packed_ctc_loss: target_lengths must lie in [0, U"),
    "target_lengths-other-device": (_set("target_lengths", lambda a, d: a["target_lengths"].to(_other_device(d))),
                                    ValueError, "target_lengths", "must be on log_probs's device"),
    # the options
    "blank-negative": (lambda a, d: dict(a, blank=-1), ValueError, "blank", "must lie in [0, C=5); got -1"),
    "blank-too-large": (lambda a, d: dict(a, blank=5), ValueError, "blank", "must lie in [0, C=5); got 5"),
    "blank-float": (lambda a, d: dict(a, blank=0.0), TypeError, "blank", "must be an int; got float"),
    "blank-bool": (lambda a, d: dict(a, blank=True), TypeError, "blank", "must be an int; got bool"),
    "blank-tensor": (lambda a, d: dict(a, blank=torch.tensor(0)), TypeError, "blank", "got Tensor"),
    "reduction-unknown": (lambda a, d: dict(a, reduction="average"), ValueError, "reduction",
                          "must be one of ('none', 'sum', 'mean'); got 'average'"),
    "reduction-capitalised": (lambda a, d: dict(a, reduction="Mean"), ValueError, "reduction", "got 'Mean'"),
    "reduction-none-object": (lambda a, d: dict(a, reduction=None), ValueError, "reduction", "got None"),
    "zero_infinity-none": (lambda a, d: dict(a, zero_infinity=None), TypeError, "zero_infinity",
                           "must be a bool; got NoneType"),
    "zero_infinity-int": (lambda a, d: dict(a, zero_infinity=1), TypeError, "zero_infinity", "got int"),
}


@pytest.mark.parametrize("strict", [False, True], ids=["default", "strict"])
@pytest.mark.parametrize("case", list(BAD_INPUTS), ids=list(BAD_INPUTS))
def test_bad_input(device, case, strict):
    """Each bad input raises its error: in strict mode (and for CPU tensors) within the
    call, otherwise no later than ``check_errors``; and nothing is left to report after."""
    change, error, argument, words = BAD_INPUTS[case]
    arguments = change(good_arguments(device), device)
    with pytest.raises(error, match=re.escape(words)) as raised, pk.strict_checks(strict):
        pk.packed_ctc_loss(**arguments)
        if not strict:
            pk.check_errors()
    message = str(raised.value)
    assert message.startswith(f"{argument} ") or message.startswith(f"packed_ctc_loss: {argument} "), message
    pk.check_errors()


def test_a_violation_is_raised_by_the_next_call(device, monkeypatch):
    """Without the wait at the end of the call (the default mode on a GPU, stood in for
    here), a bad call returns, and its violation is raised at the start of the next call
    into the package, whatever its arguments, once: the call after that runs."""
    from packed_kernels import validation

    arguments = good_arguments(device)
    bad = dict(arguments, target_lengths=torch.tensor([2, 7], device=device))
    monkeypatch.setattr(validation, "values_checked", lambda device: None)
    pk.packed_ctc_loss(**bad)
    with pytest.raises(ValueError, match=re.escape("packed_ctc_loss: target_lengths must lie in [0, U = "
                                                   "targets.shape[1]], which fails at utterance 1")):
        pk.packed_ctc_loss(**arguments)
    assert torch.isfinite(pk.packed_ctc_loss(**arguments))


EMPTY_BATCHES = {
    # name: (T_total, cu_seqlens, the message's start, or None for a good call)
    "good": (0, [0], None),
    "cu_seqlens-not-from-0": (0, [3], "packed_ctc_loss: cu_seqlens must start at 0, which fails at entry 0"),
    "cu_seqlens-short-of-T_total": (7, [0], "packed_ctc_loss: cu_seqlens must end at T_total = log_probs.shape[0], "
                                            "which fails at entry 0"),
}


@pytest.mark.parametrize("strict", [False, True], ids=["default", "strict"])
@pytest.mark.parametrize("case", list(EMPTY_BATCHES))
def test_no_utterances(device, case, strict):
    """B = 0: ``cu_seqlens`` has one entry, and no utterance has a label sort to check it:
    the check runs anyway (one program), and a good call gives the empty loss."""
    T_total, cu, message = EMPTY_BATCHES[case]
    log_probs = torch.zeros(T_total, 5, device=device).log_softmax(-1)
    arguments = dict(log_probs=log_probs, cu_seqlens=torch.tensor(cu, device=device),
                     targets=torch.zeros(0, 3, dtype=torch.long, device=device),
                     target_lengths=torch.zeros(0, dtype=torch.long, device=device), reduction="none")
    if message is None:
        assert pk.packed_ctc_loss(**arguments).shape == (0,)
        return
    with pytest.raises(ValueError, match="^" + re.escape(message)), pk.strict_checks(strict):
        pk.packed_ctc_loss(**arguments)
        if not strict:
            pk.check_errors()


def test_the_table_covers_every_argument():
    named = {row[2] for row in BAD_INPUTS.values()}
    assert named == {"log_probs", "cu_seqlens", "targets", "target_lengths", "blank", "reduction", "zero_infinity"}


@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_good_arguments_give_the_reference_loss(device, reduction):
    """The call every row spoils is itself good: its loss and gradient are the NumPy stage's
    (the junk beyond each target length is never read)."""
    arguments = good_arguments(device)
    x = arguments["log_probs"].double().requires_grad_()
    loss = pk.packed_ctc_loss(**dict(arguments, log_probs=x), reduction=reduction)
    (grad,) = torch.autograd.grad(loss.sum(), x)
    expected_loss, expected_grad = ctc_loss_numpy(
        x.detach().cpu().numpy(), np.array([0, 4, 7]), np.array([[1, 2, 0], [4, 0, 0]]), np.array([2, 1]), 0,
        reduction, False)
    assert_close(f"{reduction} loss", loss, torch.from_numpy(np.asarray(expected_loss)), atol=1e-12, rtol=1e-12)
    assert_close(f"{reduction} gradient", grad, torch.from_numpy(expected_grad), atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("cu, where", [([1, 5, 10], "entry 0"), ([0, 6, 5, 10], "entry 2"), ([0, 5, 9], "entry 2"),
                                       ([3], "entry 0")])
def test_host_checks_name_the_entry_the_kernels_would(cu, where):
    """The padded stage's host checks of ``cu_seqlens`` (CPU tensors beside compiled
    kernels) report each violation at the entry the label-groups kernel names."""
    from packed_kernels.ops.ctc import api

    B = len(cu) - 1
    checks = api._value_checks("packed_ctc_loss", "log_probs")
    with pytest.raises(ValueError, match=f"cu_seqlens .*fails at {where}$"):
        api._check_values_on_host(checks, torch.tensor(cu), torch.ones(B, 2, dtype=torch.long),
                                  torch.full((B,), 2), 10, 4)
