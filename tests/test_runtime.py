"""Where the kernels run: importing the package after triton or torch.compile changes nothing."""
import os
import subprocess
import sys
import textwrap
import types

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


# --- CachedLaunch: the JIT once per specialisation, then the compiled launcher ----------------

class CompiledKernel:
    """Stands for Triton's compiled kernel (matched by class name): records its launches."""

    def __init__(self, number):
        self.number, self.function, self.packed_metadata, self.launches = number, f"f{number}", "meta", []

    def run(self, *call):
        self.launches.append(call)


class FakeJIT:
    """Stands for a ``JITFunction`` of ``(x_ptr, n, BLOCK: constexpr)``: each launch through
    it compiles a new kernel, so a test can tell the JIT's launches from the cached ones."""

    arg_names = ["x_ptr", "n", "BLOCK"]

    def __init__(self):
        self.compiled = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.compiled.append(CompiledKernel(len(self.compiled)))
            return self.compiled[-1]
        return launch


@pytest.fixture
def fake_gpu(monkeypatch):
    from packed_kernels import runtime

    class Driver:  # Triton's active driver: device 0, stream 1234
        def get_current_device(self):
            return 0

        def get_current_stream(self, device):
            return 1234

    monkeypatch.setattr(runtime, "_triton_driver", lambda: types.SimpleNamespace(active=Driver()))
    monkeypatch.setattr(runtime, "_launch_hooks_installed", lambda: False)
    jit = FakeJIT()
    kernel = runtime.CachedLaunch(jit)
    assert not kernel.compiles  # (not a JITFunction)
    kernel.compiles = True
    return jit, kernel


def test_cached_launch_calls_the_compiled_launcher_with_every_parameter_in_order(fake_gpu):
    import torch

    jit, kernel = fake_gpu
    x = torch.zeros(64)
    first = kernel[(3,)](x, 100, BLOCK=32, num_warps=4)
    assert len(jit.compiled) == 1 and first.launches == []  # the JIT launched it
    again = kernel[(5, 2)](x, 100, BLOCK=32, num_warps=4)
    assert again is first and len(jit.compiled) == 1
    assert first.launches == [(5, 2, 1, 1234, "f0", "meta", None, None, None, x, 100, 32)]


@pytest.mark.parametrize("change", ["misaligned pointer", "dtype", "int equal to 1", "int divisible by 16",
                                    "int beyond int32", "constexpr", "option"])
def test_cached_launch_compiles_again_for_every_fact_the_jit_specialises_on(fake_gpu, change):
    import torch

    jit, kernel = fake_gpu
    x = torch.zeros(64)
    args, kwargs = [x, 100], {"BLOCK": 32, "num_warps": 4}
    kernel[(1,)](*args, **kwargs)
    if change == "misaligned pointer":
        args[0] = x[1:]
    elif change == "dtype":
        args[0] = x.double()
    elif change == "int equal to 1":
        args[1] = 1
    elif change == "int divisible by 16":
        args[1] = 96
    elif change == "int beyond int32":
        args[1] = 2 ** 31 + 100
    elif change == "constexpr":
        kwargs["BLOCK"] = 64
    else:
        kwargs["num_warps"] = 8
    kernel[(1,)](*args, **kwargs)
    assert len(jit.compiled) == 2, change
    kernel[(1,)](*args, **kwargs)
    assert len(jit.compiled) == 2 and len(jit.compiled[1].launches) == 1


def test_cached_launch_leaves_hooked_interpreted_and_unknown_launches_to_the_jit(fake_gpu, monkeypatch):
    import torch
    from packed_kernels import runtime

    jit, kernel = fake_gpu
    x = torch.zeros(64)
    kernel[(1,)](x, 100, BLOCK=32)
    monkeypatch.setattr(runtime, "_launch_hooks_installed", lambda: True)
    kernel[(1,)](x, 100, BLOCK=32)
    monkeypatch.setattr(runtime, "_launch_hooks_installed", lambda: False)
    kernel[(1,)](x, [100], BLOCK=32)  # a type the key does not describe
    kernel[lambda meta: (1,)](x, 100, BLOCK=32)  # a callable grid
    kernel.compiles = False  # an interpreted kernel
    kernel[(1,)](x, 100, BLOCK=32)
    assert len(jit.compiled) == 5 and all(c.launches == [] for c in jit.compiled)


def test_the_package_kernels_compile_exactly_where_triton_compiles():
    from packed_kernels import runtime
    from packed_kernels.ops.segment import triton_kernels as tk

    assert tk.segment_sum_rows_kernel.compiles == (not runtime.INTERPRETED)


def test_launch_hooks_installed_sees_a_hook_added_to_tritons_chain():
    triton = pytest.importorskip("triton")
    from packed_kernels import runtime

    if not hasattr(triton, "knobs"):
        assert runtime._launch_hooks_installed()
        return
    chain = triton.knobs.runtime.launch_enter_hook
    assert not runtime._launch_hooks_installed()
    hook = lambda metadata: None
    chain.add(hook)
    try:
        assert runtime._launch_hooks_installed()
    finally:
        chain.remove(hook)


@pytest.mark.parametrize("which", ["launch_enter_hook", "launch_exit_hook"])
def test_launch_hooks_installed_sees_a_function_set_in_place_of_either_chain(monkeypatch, which):
    triton = pytest.importorskip("triton")
    from packed_kernels import runtime

    if not hasattr(triton, "knobs"):
        pytest.skip("a Triton release without knobs: every launch goes through the JIT")
    assert not runtime._launch_hooks_installed()
    monkeypatch.setattr(triton.knobs.runtime, which, lambda metadata: None)
    assert runtime._launch_hooks_installed()
