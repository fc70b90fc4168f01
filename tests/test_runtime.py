"""Where the kernels run: importing the package after triton or torch.compile changes nothing."""
import os
import subprocess
import sys
import textwrap

import pytest

_CHECK = textwrap.dedent("""
    import torch
    import packed_kernels as pk
    from packed_kernels import runtime

    assert runtime.INTERPRETED == (not torch.cuda.is_available()), runtime.INTERPRETED
    device = runtime.KERNEL_DEVICE
    x = torch.randn(6, 3, dtype=torch.float64, device=device)
    idx = torch.tensor([0, 0, 1, 1, 1, 3], dtype=torch.int32, device=device)
    expected = torch.zeros(4, 3, dtype=torch.float64, device=device).index_add_(0, idx.long(), x)
    torch.testing.assert_close(pk.segmented_sum(x, idx, 4), expected, rtol=0, atol=1e-12)
    logits = torch.randn(3, 4, 4, dtype=torch.float64, device=device)
    R = pk.sinkhorn(logits, 50)
    torch.testing.assert_close(R.sum(-1), torch.ones(3, 4, dtype=torch.float64, device=device))
    print("ok")
""")

_PRELUDES = {
    "triton": "import triton\nimport triton.language as tl\n",
    "dynamo": "import torch._dynamo\n",
    "torch.compile": "import torch\ntorch.compile(lambda t: t * 2)(torch.ones(3))\n",
}


@pytest.mark.parametrize("prelude", list(_PRELUDES), ids=list(_PRELUDES))
def test_import_after_triton_or_torch_compile(prelude):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", _PRELUDES[prelude] + _CHECK], env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("ok"), result.stdout
