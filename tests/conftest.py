"""Shared fixtures: the tests are written once and run where the kernels run.

On a CUDA machine the Triton kernels are compiled and the ``device`` fixture is
``"cuda"``; without a GPU they run through Triton's interpreter on ``"cpu"``. A test
that needs compiled kernels (large sizes, programs that wait for each other, CUDA
graphs) is marked ``@pytest.mark.gpu_only`` and is skipped under the interpreter.
"""
import pytest
import torch

from packed_kernels import runtime


@pytest.fixture(scope="session")
def device() -> str:
    return runtime.KERNEL_DEVICE


@pytest.fixture(autouse=True)
def _exact_float32_matmul():
    # References in float32 must not silently use TF32 on the GPU.
    old = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


@pytest.fixture(autouse=True)
def _no_violation_left_behind():
    # A value violation that a test's calls reported and the test did not expect fails
    # that test here, instead of surfacing in whichever test calls the package next.
    from packed_kernels import validation

    validation.check_errors()
    yield
    validation.check_errors()


def pytest_report_header(config):
    import triton

    where = "interpreted on the CPU" if runtime.INTERPRETED else "compiled for the GPU"
    return f"torch {torch.__version__}, triton {triton.__version__}: Triton kernels {where}"


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu_only: needs the compiled kernels on a CUDA GPU")


def pytest_collection_modifyitems(config, items):
    if not runtime.INTERPRETED:
        return
    skip = pytest.mark.skip(reason="needs the compiled kernels on a CUDA GPU (here they are interpreted)")
    for item in items:
        if "gpu_only" in item.keywords:
            item.add_marker(skip)
