"""The data-parallel example (examples/ddp_training.py) under torchrun with two ranks,
and its checker on its own: a wrong gradient must be reported."""
import importlib.util
import os
import pathlib
import subprocess
import sys

import torch

_ROOT = pathlib.Path(__file__).resolve().parents[1]
_EXAMPLE = _ROOT / "examples" / "ddp_training.py"


def _example_module():
    spec = importlib.util.spec_from_file_location("ddp_training", _EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_two_ranks_match_one_process_on_the_whole_batch():
    """DDP's all-reduced gradients equal one process's on the whole batch, and the
    PersistentLSTM inference equals nn.LSTM (the script checks, prints a table and
    exits non-zero on a mismatch). Two GPUs run it with NCCL, one GPU with gloo (both
    ranks on it), the CPU with gloo (the kernels interpreted)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(_ROOT), os.environ.get("PYTHONPATH")])))
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(_EXAMPLE)],
        cwd=_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"exit status {run.returncode}\n{run.stdout}\n{run.stderr[-4000:]}"
    lines = run.stdout.splitlines()
    assert lines[-1] == "all match", run.stdout
    module = _example_module()
    rows = ["gradients equal on every rank", "CTC loss (sum over ranks)",
            *(name for name, _ in module.Recogniser().named_parameters()),
            "PersistentLSTM encoder vs nn.LSTM", "PersistentLSTM log-probs vs nn.LSTM"]
    for row in rows:
        (line,) = [line for line in lines if line.startswith(row + " ")]
        assert line.endswith(" ok"), line
    assert "2 ranks" in lines[0] and "shards of [3, 2]" in lines[0], lines[0]


def test_shards_cover_the_batch_once():
    module = _example_module()
    batch = module.make_batch(3, torch.device("cpu"))
    shards = [module.shard(batch, rank, 2) for rank in range(2)]
    assert [s.size for s in shards] == [3, 2]
    assert torch.equal(torch.cat([s.frames.data for s in shards]), batch.frames.data)
    assert torch.equal(torch.cat([s.frames.lengths for s in shards]), batch.frames.lengths)
    assert torch.equal(torch.cat([s.targets for s in shards]), batch.targets)
    for s in shards:
        assert int(s.frames.cu_seqlens[-1]) == s.frames.data.shape[0]


def test_checker_flags_a_wrong_gradient():
    module = _example_module()
    expected = torch.randn(40, dtype=torch.float32)
    close = expected * (1 + 1e-6)
    diff, excess = module.within_tolerance(close, expected)
    assert excess <= 0 and diff == float((close.double() - expected.double()).abs().max())
    wrong = expected.clone()
    wrong[7] *= 1.01  # one element one percent off
    assert module.within_tolerance(wrong, expected)[1] > 0
    assert module.within_tolerance(expected * 1.2, expected)[1] > 0  # a misplaced batch scale
    assert module.within_tolerance(torch.full_like(expected, float("nan")), expected)[1] > 0
