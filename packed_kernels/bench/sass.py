"""Dump and compare the sm_90 SASS of every default kernel configuration, without a GPU.

Two commands, run from a checkout (the checkout on ``sys.path``: its root as the
working directory, or on ``PYTHONPATH``)::

    python -m packed_kernels.bench.sass --out DIR          # capture and compile
    python -m packed_kernels.bench.sass --compare DIR_A DIR_B

A refactor that should not change the generated code is checked by capturing before
(``--out before`` in a checkout of the old commit) and after (``--out after``), then
``--compare before after``.

Capturing (``--out``)
---------------------
The script drives the package only through its public API (``packed_ctc_loss``,
``sinkhorn``, ``sinkhorn_backward``, the ``segmented_*`` functions,
``PersistentLSTM``, ``pack``), on CPU tensors, while the package believes it runs
compiled kernels on an H200:

* ``TRITON_INTERPRET=0`` before anything is imported (the script re-executes itself
  with it when needed), so the kernels are decorated for compilation;
* ``INTERPRETED = False`` and ``KERNEL_DEVICE = "cpu"`` in every module of the package
  that defines them (so CPU tensors pass the device checks), every binding of
  ``sm_count`` answers 132, and ``torch.cuda.get_device_properties`` answers an H200
  (132 SMs, :data:`TARGET_L2_BYTES` of L2); ``torch.cuda.is_available()`` stays False;
* every function of the package that takes a device argument and compares its
  ``.type`` with ``"cuda"`` (the LSTM's configuration chooser and L2 query) is
  wrapped so that it sees a CUDA device instead of the CPU one. Device checks made
  on a *tensor* (``t.device.type``) are left alone and listed at start-up; in the
  package as written they only size a launch grid, never a compiled kernel;
* Triton's active driver is replaced by one whose target is
  ``GPUTarget("cuda", 90, 32)`` and whose device and stream are 0, and
  ``JITFunction.run`` is called with ``warmup=True`` with ``JITFunction._do_compile``
  intercepted: the JIT's own binder computes the specialisation (integer arguments
  equal to 1, 16-divisible integers and 16-byte aligned pointers, exactly as on a GPU
  for the same shapes), its own option parser the launch options (``num_warps``,
  ``num_stages``, ``maxnreg``, ...), and the interception records them instead of
  compiling. Nothing is launched: outputs are uninitialised memory, so every value
  computed from them is garbage, which does not matter for the code that is compiled.

After the workload, each distinct (kernel, specialisation, options) is compiled with
``triton.compile(..., target=GPUTarget("cuda", 90, 32))`` in a process pool
(``--jobs``; Triton's cache, ``TRITON_CACHE_DIR``, and the disassembly kept in its
``packed_kernels_sass`` folder make a repeated run fast), and written as
``DIR/<kernel>__<hash>.sass`` (``cuobjdump -sass`` of the cubin; ``<hash>`` is a short
hash of the signature, specialisation, constexprs and options), with ``DIR/index.json``:
per kernel its name, module, signature, constexprs, attributes, non-default options,
registers, spill bytes, stack, shared memory, instruction count and the workload cases
that launched it; and the cases or compilations that failed.

The workload (see :func:`workload`) covers the shapes that select every default
configuration: CTC at several B / U / C (C = 29 and C = 1025), float32 and bfloat16,
each reduction, forward and backward, and the forced aligner (from log-probabilities and
from logits); Sinkhorn at n = 1, 2, 3, 4, 5, 8, 16, 32, float32, bfloat16 and float64,
20 and 40 iterations, the implicit backward (direct solve and conjugate gradient) and
the unrolled one, and ``sinkhorn_backward``; the six segment operations on ``(N,)``,
``(N, 3)`` and ``(N, 64)`` rows, float32, bfloat16 and float64, short and long segments
and a tiny input, forward, backward and double backward; ``PersistentLSTM`` (2 layers,
bidirectional, packed input) at hidden sizes 32, 64, 128, 256 and batches 1, 8, 32, 128,
256 under ``torch.no_grad``.
Each case runs in its own ``try``; failures are reported at the end. ``--only``
restricts the workload to some of ``ctc``, ``sinkhorn``, ``segment``, ``lstm``.

Comparing (``--compare A B``)
-----------------------------
Each SASS file is normalised: the headers, ``Function :`` lines and every
``/* ... */`` comment (addresses and instruction encodings) are dropped, the
functions' own names become ``<fn0>``, ``<fn1>``, ... and other symbols ``<sym>``
(labels ``.L_x_N`` stay), so a renamed kernel still matches. Every kernel of ``A`` is
then looked up by its exact normalised text among *all* kernels of ``B`` (names and
constexprs may have changed): ``identical``. The remaining kernels of ``A`` and ``B``
are paired by name similarity (then by how much of their configuration and
instruction mix they share): ``changed``, with the number of differing lines;
kernels of ``A`` left without a partner are ``missing``, and those of ``B`` ``new``.
Kernels of equal code are paired one to one; a kernel of ``B`` whose code ``A`` has
fewer copies of (a new configuration that compiles to existing code) is a
``duplicate``. ``--diff`` prints the normalised diff of every changed pair.

Exit status: 0 when everything was captured and compiled (``--out``) or when every
kernel is identical and none is new or a duplicate (``--compare``); 1 otherwise.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import functools
import glob
import hashlib
import inspect
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from types import SimpleNamespace
from typing import Callable, Dict, List

#: What the package is made to believe it runs on.
TARGET_SM_COUNT = 132
TARGET_L2_BYTES = 60 * 1024 * 1024
TARGET_ARCH = 90
WARP_SIZE = 32

GROUPS = ("ctc", "sinkhorn", "segment", "lstm")

#: Public names whose first use imports each subpackage (and its kernels).
PUBLIC_NAMES = (
    "packed_ctc_loss", "packed_ctc_align", "sinkhorn", "sinkhorn_backward", "segmented_sum", "segmented_mean", "segmented_dot",
    "segmented_mul", "segmented_rms_norm", "segmented_matvec", "PersistentLSTM", "pack", "unpack",
)


# ---------------------------------------------------------------------------------------
# making the package believe it runs on an H200


class _FakeCudaDevice:
    """Stands for ``torch.device("cuda", 0)`` where a function only asks ``.type``/``.index``."""

    type = "cuda"
    index = 0

    def __repr__(self):
        return "device(type='cuda', index=0)"

    __str__ = __repr__


_FAKE_DEVICE = _FakeCudaDevice()


def _h200_properties(device=None):
    return SimpleNamespace(
        name="NVIDIA H200", major=9, minor=0, multi_processor_count=TARGET_SM_COUNT, L2_cache_size=TARGET_L2_BYTES,
        total_memory=141 * 10 ** 9, warp_size=WARP_SIZE, regs_per_multiprocessor=65536,
        shared_memory_per_block=49152, shared_memory_per_block_optin=232448,
        shared_memory_per_multiprocessor=233472, max_threads_per_multi_processor=2048,
    )


def _fake_sm_count(device=None) -> int:
    return TARGET_SM_COUNT


class _CaptureState:
    """What the intercepted JIT records: one entry per distinct compilation."""

    def __init__(self):
        self.captures: List[dict] = []
        self.by_key: Dict[tuple, dict] = {}
        self.group = ""
        self.case = ""


_STATE = _CaptureState()


def _install_triton_interception():
    """Fake driver (sm_90 target, device 0, stream 0); ``run`` always warms up; the
    compilation itself is recorded instead of done."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    target = GPUTarget("cuda", TARGET_ARCH, WARP_SIZE)

    class FakeDriver:
        def get_current_target(self):
            return target

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_active_torch_device(self):
            return torch.device("cpu")

        def get_device_interface(self):
            return torch.cuda

    driver.set_active(FakeDriver())

    original_run = JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        return original_run(self, *args, grid=grid, warmup=True, **kwargs)

    def do_compile(self, key, signature, device, constexprs, options, attrs, warmup):
        identity = (id(self), str(key))
        record = _STATE.by_key.get(identity)
        if record is None:
            record = {"fn": self, "signature": signature, "constexprs": constexprs, "options": options,
                      "attrs": attrs, "group": _STATE.group, "cases": []}
            _STATE.by_key[identity] = record
            _STATE.captures.append(record)
        if _STATE.case not in record["cases"]:
            record["cases"].append(_STATE.case)
        return None  # run() returns before any launch

    JITFunction.run = run
    JITFunction._do_compile = do_compile
    return target, triton.__version__


def _package_modules():
    return [m for name, m in sorted(sys.modules.items())
            if m is not None and (name == "packed_kernels" or name.startswith("packed_kernels."))
            and not name.startswith("packed_kernels.bench")]


def _takes_device(fn) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return any(name == "device" or name.endswith("_device") for name in params)


#: Functions that ask for a CUDA device only to move host data there (they select no
#: kernel configuration), left to see the CPU device.
_HOST_DATA_FUNCTIONS = {"packed_kernels.ops.ctc.api._lengths_argument"}
_CUDA_TYPE_TEST = re.compile(r"""\.type\s*(?:!=|==)\s*["']cuda["']|["']cuda["']\s*(?:!=|==)\s*\w+\.type""")
_TENSOR_TYPE_TEST = re.compile(r"""\w+\.device\.type\s*(?:!=|==)\s*["']cuda["']""")


def _with_cuda_device(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        import torch

        def swap(value):
            return _FAKE_DEVICE if isinstance(value, torch.device) and value.type == "cpu" else value

        return fn(*(swap(a) for a in args), **{k: swap(v) for k, v in kwargs.items()})

    wrapper.__sass_wrapped__ = True
    return wrapper


def simulate_h200() -> List[str]:
    """Import every subpackage through the public API and patch it to believe it runs on
    an H200 with CPU tensors. Returns a description of each patch, for the log."""
    import torch

    notes = []
    torch.cuda.get_device_properties = _h200_properties
    notes.append("torch.cuda.get_device_properties -> H200 properties")
    import packed_kernels as pk

    for name in PUBLIC_NAMES:
        try:
            getattr(pk, name)
        except Exception as err:  # reported, and the cases that need it fail on their own
            notes.append(f"could not import packed_kernels.{name}: {type(err).__name__}: {err}")
    runtime = getattr(pk, "runtime", None)
    original_sm_count = getattr(runtime, "sm_count", None)
    replaced = {}  # id(original function) -> wrapper, so that every binding gets the same one
    tensor_checks = []
    for module in _package_modules():
        for attr, value in list(vars(module).items()):
            where = f"{module.__name__}.{attr}"
            if attr == "INTERPRETED" and isinstance(value, bool):
                setattr(module, attr, False)
                notes.append(f"{where} = False")
            elif attr == "KERNEL_DEVICE" and isinstance(value, str):
                setattr(module, attr, "cpu")
                notes.append(f"{where} = 'cpu'")
            elif callable(value) and (value is original_sm_count or (attr == "sm_count" and inspect.isfunction(value))):
                setattr(module, attr, _fake_sm_count)
                notes.append(f"{where} -> {TARGET_SM_COUNT}")
            elif inspect.isfunction(value) and not getattr(value, "__sass_wrapped__", False):
                if id(value) in replaced:
                    setattr(module, attr, replaced[id(value)])
                    continue
                if value.__module__ != module.__name__:
                    continue  # wrapped where it is defined; other bindings are caught by identity
                try:
                    source = inspect.getsource(value)
                except (OSError, TypeError):
                    continue
                if module.__name__.endswith(".validation") or where in _HOST_DATA_FUNCTIONS:
                    continue  # host memory and host data either way: the CPU ones here
                if _takes_device(value) and _CUDA_TYPE_TEST.search(source):
                    replaced[id(value)] = wrapper = _with_cuda_device(value)
                    setattr(module, attr, wrapper)
                    notes.append(f"{where}(device) sees a CUDA device")
                elif _TENSOR_TYPE_TEST.search(source):
                    tensor_checks.append(where)
    # bindings of a wrapped function imported into modules visited before its own
    for module in _package_modules():
        for attr, value in list(vars(module).items()):
            if id(value) in replaced:
                setattr(module, attr, replaced[id(value)])
    for where in tensor_checks:
        notes.append(f"left as is (tests a tensor's device): {where}")
    return notes


# ---------------------------------------------------------------------------------------
# the workload: public API only


@dataclasses.dataclass
class Case:
    group: str
    label: str
    run: Callable[[], None]


def _ctc_cases(pk, torch) -> List[Case]:
    # (B, U, C): target blocks 16 ... 256 lanes, class blocks 32 and 1024 (looped), and
    # batch blocks 16 ... 128 of the gradient kernel's weights
    shapes = [(8, 12, 29), (32, 50, 29), (128, 200, 29), (16, 100, 1025), (64, 30, 1025)]
    options = [("none", False), ("sum", False), ("mean", False), ("mean", True)]
    cases = []
    for B, U, C in shapes:
        for dtype in (torch.float32, torch.bfloat16):
            for reduction, zero_infinity in options:
                def run(B=B, U=U, C=C, dtype=dtype, reduction=reduction, zero_infinity=zero_infinity):
                    g = torch.Generator().manual_seed(1000 * B + U)
                    target_lengths = torch.randint(max(1, U // 2), U + 1, (B,), generator=g)
                    target_lengths[0] = U
                    frames = 2 * target_lengths + 1 + torch.randint(0, 50, (B,), generator=g)
                    cu_seqlens = pk.cu_seqlens_from_lengths(frames)
                    log_probs = torch.randn(int(frames.sum()), C, generator=g).log_softmax(-1).to(dtype)
                    log_probs.requires_grad_()
                    targets = torch.randint(1, C, (B, U), generator=g)
                    loss = pk.packed_ctc_loss(log_probs, cu_seqlens, targets, target_lengths,
                                              reduction=reduction, zero_infinity=zero_infinity)
                    if reduction == "none":
                        loss = (loss * torch.rand(B, generator=g)).sum()
                    loss.backward()

                label = f"ctc B={B} U={U} C={C} {_dtype_name(dtype)} {reduction} zero_infinity={zero_infinity}"
                cases.append(Case("ctc", label, run))
        for dtype in (torch.float32, torch.bfloat16):
            for from_logits in (False, True):
                def align(B=B, U=U, C=C, dtype=dtype, from_logits=from_logits):
                    g = torch.Generator().manual_seed(1000 * B + U)
                    target_lengths = torch.randint(max(1, U // 2), U + 1, (B,), generator=g)
                    frames = 2 * target_lengths + 1 + torch.randint(0, 50, (B,), generator=g)
                    scores = torch.randn(int(frames.sum()), C, generator=g).to(dtype)
                    targets = torch.randint(1, C, (B, U), generator=g)
                    if from_logits:
                        pk.packed_ctc_align_from_logits(scores, pk.cu_seqlens_from_lengths(frames), targets,
                                                        target_lengths)
                    else:
                        pk.packed_ctc_align(scores.log_softmax(-1), pk.cu_seqlens_from_lengths(frames), targets,
                                            target_lengths)

                label = f"ctc_align B={B} U={U} C={C} {_dtype_name(dtype)} from_logits={from_logits}"
                cases.append(Case("ctc", label, align))
    return cases


def _sinkhorn_cases(pk, torch) -> List[Case]:
    cases = []
    for n in (1, 2, 3, 4, 5, 8, 16, 32):
        tokens = 4096 if n <= 8 else 512
        for dtype in (torch.float32, torch.bfloat16, torch.float64):
            for iters in (20, 40):
                for backward, cg_iters in (("implicit", None), ("implicit", min(10, 2 * n)), ("unrolled", None)):
                    def run(n=n, tokens=tokens, dtype=dtype, iters=iters, backward=backward, cg_iters=cg_iters):
                        g = torch.Generator().manual_seed(n)
                        logits = torch.randn(tokens, n, n, generator=g).to(dtype).requires_grad_()
                        R = pk.sinkhorn(logits, iters, backward=backward, cg_iters=cg_iters)
                        R.backward(torch.randn(R.shape, generator=g).to(dtype))

                    label = f"sinkhorn n={n} {_dtype_name(dtype)} iters={iters} {backward} cg_iters={cg_iters}"
                    cases.append(Case("sinkhorn", label, run))
            for cg_iters in (None, min(10, 2 * n)):
                def run(n=n, tokens=tokens, dtype=dtype, cg_iters=cg_iters):
                    g = torch.Generator().manual_seed(n)
                    R = torch.rand(tokens, n, n, generator=g).to(dtype)
                    pk.sinkhorn_backward(R, torch.randn(R.shape, generator=g).to(dtype), cg_iters=cg_iters)

                cases.append(Case("sinkhorn", f"sinkhorn_backward n={n} {_dtype_name(dtype)} cg_iters={cg_iters}", run))
    return cases


def _three_orders(torch, fn, inputs):
    """Forward, backward (with a graph) and double backward of ``fn`` at ``inputs``."""
    out = fn(*inputs)
    v = torch.randn(out.shape, dtype=out.dtype).requires_grad_()
    grads = torch.autograd.grad(out, inputs, v, create_graph=True, allow_unused=True)
    total = sum((g * torch.randn(g.shape, dtype=g.dtype)).sum() for g in grads if g is not None)
    if isinstance(total, torch.Tensor) and total.requires_grad:
        torch.autograd.grad(total, [*inputs, v], allow_unused=True)


def _segment_cases(pk, torch) -> List[Case]:
    # (label, rows, segments): short segments (4 rows on average), long ones (5,000
    # rows), and an input smaller than one chunk
    sizes = [("short", 20000, 5000), ("long", 20000, 4), ("tiny", 40, 5)]
    cases = []
    for cols in (None, 3, 64):
        for dtype in (torch.float32, torch.bfloat16, torch.float64):
            for size, N, S in sizes:
                if size == "tiny" and dtype != torch.float32:
                    continue
                shape = (N,) if cols is None else (N, cols)

                def inputs(*shapes, N=N, S=S, dtype=dtype):
                    g = torch.Generator().manual_seed(N + S)
                    idx = torch.sort(torch.randint(0, S, (N,), generator=g)).values.to(torch.int32)
                    return idx, [torch.randn(s, generator=g).to(dtype).requires_grad_() for s in shapes]

                seg_shape = (S,) + shape[1:]
                ops = [
                    ("sum", lambda idx, x, S=S: pk.segmented_sum(x, idx, S), [shape]),
                    ("mean", lambda idx, x, S=S: pk.segmented_mean(x, idx, S), [shape]),
                    ("dot", lambda idx, x, y, S=S: pk.segmented_dot(x, y, idx, S), [shape, shape]),
                    ("mul", lambda idx, x, y, S=S: pk.segmented_mul(x, y, idx, S), [shape, seg_shape]),
                    ("rms_norm", lambda idx, x, S=S: pk.segmented_rms_norm(x, idx, S), [shape]),
                ]
                if cols is not None:
                    ops.append(("mul per-segment scalar", lambda idx, x, y, S=S: pk.segmented_mul(x, y, idx, S),
                                [shape, (S,)]))
                    ops.append(("matvec", lambda idx, v, m, S=S: pk.segmented_matvec(v, m, idx, S),
                                [shape, (S, cols, cols)]))
                for op, fn, shapes in ops:
                    def run(fn=fn, shapes=shapes, inputs=inputs):
                        idx, tensors = inputs(*shapes)
                        _three_orders(torch, lambda *t: fn(idx, *t), tensors)

                    label = f"segmented {op} x={'(N,)' if cols is None else f'(N, {cols})'} {_dtype_name(dtype)} {size}"
                    cases.append(Case("segment", label, run))
    return cases


def _lstm_cases(pk, torch) -> List[Case]:
    cases = []
    modules = {}
    # 589 frames a sequence (pyannote's segmentation stack, as in the LSTM benchmark), a few
    # shorter: a layer's projected inputs (frames x 32 H bytes) are then either well below
    # or well above half of the L2 (the launcher's test for prefetching into L2), for any
    # L2 of 50 to 60 MiB
    frames = 589
    for hidden in (32, 64, 128, 256):
        for batch in (1, 8, 32, 128, 256):
            def run(hidden=hidden, batch=batch):
                if hidden not in modules:
                    modules.clear()
                    torch.manual_seed(hidden)
                    lstm = torch.nn.LSTM(60, hidden, num_layers=2, bidirectional=True, batch_first=True).eval()
                    make = getattr(pk.PersistentLSTM, "from_torch", pk.PersistentLSTM)
                    modules[hidden] = make(lstm)
                model = modules[hidden]
                lengths = frames - 10 * (torch.arange(batch) % 7)
                padded = torch.randn(batch, frames, 60)
                with torch.no_grad():
                    model(pk.pack(padded, lengths))

            cases.append(Case("lstm", f"PersistentLSTM hidden={hidden} batch={batch} 2 layers bidirectional packed",
                              run))
    return cases


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def workload(groups) -> List[Case]:
    import torch

    import packed_kernels as pk

    makers = {"ctc": _ctc_cases, "sinkhorn": _sinkhorn_cases, "segment": _segment_cases, "lstm": _lstm_cases}
    return [case for group in groups for case in makers[group](pk, torch)]


def run_workload(cases: List[Case]) -> List[dict]:
    failures = []
    start = time.perf_counter()
    for number, case in enumerate(cases, 1):
        _STATE.group, _STATE.case = case.group, case.label
        before = len(_STATE.captures)
        try:
            case.run()
            status = f"+{len(_STATE.captures) - before}"
        except Exception as err:
            failures.append({"group": case.group, "case": case.label, "error": f"{type(err).__name__}: {err}",
                             "traceback": traceback.format_exc(limit=6)})
            status = f"FAILED ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})"
        print(f"[{number:3d}/{len(cases)}] {case.label}: {status} (total {len(_STATE.captures)}, "
              f"{time.perf_counter() - start:.0f} s)", flush=True)
    return failures


# ---------------------------------------------------------------------------------------
# compiling the captured kernels


def _jsonable(value):
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    inner = getattr(value, "value", None)  # tl.constexpr
    if inner is not None and type(value).__name__ == "constexpr":
        return _jsonable(inner)
    return str(value)


def _path_name(fn, path) -> str:
    name = fn.arg_names[path[0]]
    return name + "".join(f"[{i}]" for i in path[1:])


def _describe(record: dict, defaults) -> dict:
    """The JSON description of a capture; ``defaults`` are the backend's default options."""
    fn = record["fn"]
    options = record["options"]
    always = ("num_warps", "num_ctas", "num_stages", "maxnreg")
    chosen = {k: _jsonable(v) for k, v in sorted(options.__dict__.items())
              if k in always or (k != "extern_libs" and getattr(defaults, k, None) != v)}
    return {
        "name": fn.__name__,
        "module": fn.module,
        "signature": {k: _jsonable(v) for k, v in record["signature"].items()},
        "constexprs": {_path_name(fn, p): _jsonable(v) for p, v in sorted(record["constexprs"].items())},
        "attrs": {_path_name(fn, p): _jsonable(v) for p, v in sorted(record["attrs"].items()) if v},
        "options": chosen,
    }


def _tool(name: str) -> str:
    from triton import knobs

    try:
        return getattr(knobs.nvidia, name).path
    except Exception:
        import triton

        return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


_PTXAS_USAGE = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_REGS = re.compile(r"Used (\d+) registers")


def _compile_one(index: int):
    """Compile capture ``index`` for sm_90 (in a forked worker); SASS and resource usage."""
    import triton
    from triton import knobs
    from triton.compiler import ASTSource

    record = _STATE.captures[index]
    target = triton.runtime.driver.active.get_current_target()
    start = time.perf_counter()
    log = io.StringIO()
    try:
        knobs.nvidia.dump_ptxas_log = True
        with contextlib.redirect_stdout(log):
            kernel = triton.compile(ASTSource(record["fn"], record["signature"], record["constexprs"], record["attrs"]),
                                    target=target, options=record["options"].__dict__)
        result = _disassemble(kernel.asm["cubin"], kernel.asm["ptx"], log.getvalue(),
                              record["options"].enable_fp_fusion)
    except Exception as err:
        return index, None, f"{type(err).__name__}: {err}"[:4000], time.perf_counter() - start
    return index, result, None, time.perf_counter() - start


def _disassemble(cubin: bytes, ptx: str, ptxas_log: str, fp_fusion: bool) -> dict:
    """SASS and resource usage of ``cubin``, kept in ``<Triton cache>/packed_kernels_sass``
    by the cubin's hash: a kernel that Triton's cache serves needs no disassembly, and no
    second ptxas run for its spill counts, the next time."""
    from triton import knobs

    digest = hashlib.sha256(cubin).hexdigest()
    cache = os.path.join(knobs.cache.dir, "packed_kernels_sass", digest[:2], digest + ".json")
    if os.path.exists(cache):
        try:
            with open(cache) as f:
                return json.load(f)
        except (OSError, ValueError):
            pass
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        sass = subprocess.run([_tool("cuobjdump"), "-sass", path], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([_tool("cuobjdump"), "-res-usage", path], capture_output=True, text=True).stdout
        if not _PTXAS_USAGE.search(ptxas_log):  # Triton's cache served the cubin: no ptxas ran
            ptx_path = os.path.join(tmp, "kernel.ptx")
            with open(ptx_path, "w") as f:
                f.write(ptx)
            fmad = [] if fp_fusion else ["--fmad=false"]
            ptxas_log = subprocess.run([_tool("ptxas"), "-v", *fmad, f"--gpu-name=sm_{TARGET_ARCH}a", ptx_path,
                                        "-o", os.path.join(tmp, "again.cubin")],
                                       capture_output=True, text=True).stderr
    resources = dict(re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", usage))
    spills = _PTXAS_USAGE.search(ptxas_log)
    regs = _PTXAS_REGS.search(ptxas_log)
    result = {
        "sass": sass,
        "registers": int(resources.get("REG", regs.group(1) if regs else -1)),
        "spill_stores": int(spills.group(2)) if spills else None,
        "spill_loads": int(spills.group(3)) if spills else None,
        "stack": int(resources["STACK"]) if "STACK" in resources else None,
        "shared": int(resources["SHARED"]) if "SHARED" in resources else None,
        "local": int(resources["LOCAL"]) if "LOCAL" in resources else None,
        "instructions": sum(1 for line in normalise_sass(sass) if not line.endswith(":")),
    }
    try:
        os.makedirs(os.path.dirname(cache), exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=os.path.dirname(cache), delete=False, suffix=".tmp") as f:
            json.dump(result, f)
        os.replace(f.name, cache)
    except OSError:
        pass  # a read-only cache only costs the next run the disassembly
    return result


def compile_all(jobs: int):
    """Compile every capture, ``jobs`` at a time (forked workers share the captures)."""
    import multiprocessing

    # in reverse workload order: the large LSTM kernels first, the many small ones last
    order = sorted(range(len(_STATE.captures)), key=lambda i: -GROUPS.index(_STATE.captures[i]["group"]))
    results = {}
    start = time.perf_counter()

    def report(done, index, error, seconds):
        record = _STATE.captures[index]
        status = "FAILED " + error.splitlines()[0] if error else "ok"
        print(f"compiled [{done:3d}/{len(order)}] {record['fn'].__name__} ({record['group']}): {status} "
              f"({seconds:.1f} s; {time.perf_counter() - start:.0f} s)", flush=True)

    if jobs > 1 and len(order) > 1:
        context = multiprocessing.get_context("fork")
        with context.Pool(jobs) as pool:
            for done, (index, result, error, seconds) in enumerate(pool.imap_unordered(_compile_one, order), 1):
                results[index] = (result, error)
                report(done, index, error, seconds)
    else:
        for done, i in enumerate(order, 1):
            index, result, error, seconds = _compile_one(i)
            results[index] = (result, error)
            report(done, index, error, seconds)
    return results


def capture(out_dir: str, groups, jobs: int) -> int:
    start = time.perf_counter()
    target, triton_version = _install_triton_interception()
    for note in simulate_h200():
        print("patched:", note)
    import torch
    from triton.compiler import make_backend

    cases = workload(groups)
    print(f"running {len(cases)} workload cases ({', '.join(groups)})", flush=True)
    failures = run_workload(cases)
    captured_at = time.perf_counter()
    print(f"captured {len(_STATE.captures)} distinct kernels in {captured_at - start:.0f} s; compiling with "
          f"{jobs} worker(s)", flush=True)
    results = compile_all(jobs)

    os.makedirs(out_dir, exist_ok=True)
    for stale in glob.glob(os.path.join(out_dir, "*.sass")) + glob.glob(os.path.join(out_dir, "index.json")):
        os.remove(stale)
    defaults = make_backend(target).parse_options({})
    kernels, compile_failures, used = [], [], set()
    for index, record in enumerate(_STATE.captures):
        entry = _describe(record, defaults)
        digest = hashlib.sha256(json.dumps({k: entry[k] for k in ("signature", "constexprs", "attrs", "options")},
                                           sort_keys=True).encode()).hexdigest()[:10]
        key = f"{entry['name']}__{digest}"
        suffix = 2
        while key in used:  # two kernels of one name in different modules, same configuration
            key = f"{entry['name']}__{digest}-{suffix}"
            suffix += 1
        used.add(key)
        result, error = results[index]
        entry = {"key": key, "group": record["group"], **entry, "cases": record["cases"]}
        if error is not None:
            compile_failures.append({**entry, "error": error})
            continue
        with open(os.path.join(out_dir, key + ".sass"), "w") as f:
            f.write(result.pop("sass"))
        kernels.append({**entry, **result, "file": key + ".sass"})
    kernels.sort(key=lambda k: k["key"])
    index = {
        "target": f"cuda sm_{TARGET_ARCH}a",
        "triton": triton_version,
        "torch": torch.__version__,
        "simulated_device": {"name": "NVIDIA H200", "sm_count": TARGET_SM_COUNT, "l2_bytes": TARGET_L2_BYTES},
        "groups": list(groups),
        "kernels": kernels,
        "failures": failures,
        "compile_failures": compile_failures,
    }
    with open(os.path.join(out_dir, "index.json"), "w") as f:
        json.dump(index, f, indent=1)

    per_group = Counter(k["group"] for k in kernels)
    print(f"\nwrote {len(kernels)} kernels to {out_dir}: "
          + ", ".join(f"{g} {per_group.get(g, 0)}" for g in groups)
          + f" (capture {captured_at - start:.0f} s, compile {time.perf_counter() - captured_at:.0f} s)")
    for failure in failures:
        print(f"case failed: {failure['case']}: {failure['error']}")
    for failure in compile_failures:
        print(f"compile failed: {failure['key']} ({failure['cases'][0]}): {failure['error'].splitlines()[0]}")
    return 1 if failures or compile_failures else 0


# ---------------------------------------------------------------------------------------
# comparing two captures

_ENCODING_OR_ADDRESS = re.compile(r"/\*[^*]*\*/")
_SYMBOL = re.compile(r"`\(([^)]*)\)")
_LABEL = re.compile(r"\.L_x_\d+")


def normalise_sass(text: str) -> List[str]:
    """The instructions and labels of ``cuobjdump -sass`` output, without headers,
    addresses, encodings or symbol names (see the module docstring)."""
    functions = re.findall(r"^\s*Function\s*:\s*(\S+)", text, flags=re.M)
    names = {name: f"<fn{i}>" for i, name in enumerate(dict.fromkeys(functions))}
    pattern = re.compile("|".join(re.escape(n) for n in sorted(names, key=len, reverse=True))) if names else None
    lines = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("code for ", "Function ", ".headerflags", "Fatbin ", "arch =", "code version",
                                        "host =", "compile_size", "identifier =", "ptxasOptions", ".section",
                                        "...")):
            continue
        line = _ENCODING_OR_ADDRESS.sub("", line).strip()
        if not line:
            continue
        if pattern is not None:
            line = pattern.sub(lambda m: names[m.group(0)], line)

        def symbol(match):
            inner = match.group(1)
            return match.group(0) if _LABEL.fullmatch(inner) or "<fn" in inner else "`(<sym>)"

        line = _SYMBOL.sub(symbol, line)
        lines.append(re.sub(r"\s+", " ", line))
    return lines


def _load(directory: str) -> Dict[str, dict]:
    meta = {}
    path = os.path.join(directory, "index.json")
    if os.path.exists(path):
        with open(path) as f:
            meta = {k["key"]: k for k in json.load(f).get("kernels", [])}
    kernels = {}
    for sass in sorted(glob.glob(os.path.join(directory, "*.sass"))):
        key = os.path.basename(sass)[:-len(".sass")]
        with open(sass) as f:
            lines = normalise_sass(f.read())
        entry = dict(meta.get(key, {}))
        entry.setdefault("name", key.split("__")[0])
        entry["lines"] = lines
        entry["text"] = "\n".join(lines)
        entry["opcodes"] = Counter(_opcode(line) for line in lines)
        kernels[key] = entry
    return kernels


def _opcode(line: str) -> str:
    words = line.split()
    if words and words[0].startswith("@"):  # a predicate
        words = words[1:]
    return words[0].split(".")[0] if words else ""


def _name_similarity(a: str, b: str) -> float:
    return 1.0 if a == b else difflib.SequenceMatcher(None, a, b).ratio()


def _config_similarity(a: dict, b: dict) -> float:
    """Shared (name, value) pairs, then shared values alone (renamed constexprs)."""
    def items(k):
        return Counter(f"{n}={v}" for part in ("constexprs", "options") for n, v in k.get(part, {}).items()) + \
            Counter(f"{n}:{v}" for n, v in k.get("signature", {}).items())

    def values(k):
        return Counter(json.dumps(v) for part in ("constexprs", "options") for v in k.get(part, {}).values())

    def overlap(x, y):
        total = sum((x | y).values())
        return sum((x & y).values()) / total if total else 1.0

    return 0.5 * overlap(items(a), items(b)) + 0.5 * overlap(values(a), values(b))


def _mix_similarity(a: dict, b: dict) -> float:
    x, y = a["opcodes"], b["opcodes"]
    total = sum((x | y).values())
    return sum((x & y).values()) / total if total else 1.0


def _diff_size(a: List[str], b: List[str]):
    added = removed = 0
    for line in difflib.unified_diff(a, b, lineterm="", n=0):
        if line.startswith("+") and not line.startswith("+++"):
            added += 1
        elif line.startswith("-") and not line.startswith("---"):
            removed += 1
    return added, removed


def _spills(entry):
    """Spill bytes (stores and loads) from the index, ``None`` when unknown."""
    if not entry or entry.get("spill_stores") is None:
        return None
    return entry["spill_stores"] + entry["spill_loads"]


def compare(dir_a: str, dir_b: str, show_diff: bool = False) -> int:
    A, B = _load(dir_a), _load(dir_b)
    if not A:
        print(f"no .sass files in {dir_a}")
        return 1
    a_by_text: Dict[str, List[str]] = {}
    b_by_text: Dict[str, List[str]] = {}
    for key, entry in A.items():
        a_by_text.setdefault(entry["text"], []).append(key)
    for key, entry in B.items():
        b_by_text.setdefault(entry["text"], []).append(key)

    def closeness(ka, kb):
        return (ka == kb, _name_similarity(A[ka]["name"], B[kb]["name"]), _config_similarity(A[ka], B[kb]))

    rows, matched_b, duplicates = {}, set(), {}
    for text, b_keys in b_by_text.items():
        a_keys = a_by_text.get(text)
        if not a_keys:
            continue
        matched_b.update(b_keys)
        # one to one within the group of equal code, closest first; A's extra copies share
        # their closest B kernel, B's extra copies are reported as duplicates
        used_b = set()
        for *_, ka, kb in sorted(((*closeness(ka, kb), ka, kb) for ka in a_keys for kb in b_keys), reverse=True):
            if ka not in rows and kb not in used_b:
                rows[ka] = ("identical", kb)
                used_b.add(kb)
        for ka in a_keys:
            rows.setdefault(ka, ("identical", max(b_keys, key=lambda kb: closeness(ka, kb))))
        for kb in b_keys:
            if kb not in used_b:
                duplicates[kb] = max(a_keys, key=lambda ka: closeness(ka, kb))
    left_a = [k for k in A if k not in rows]
    left_b = [k for k in B if k not in matched_b]
    pairs = []
    for ka in left_a:
        for kb in left_b:
            name = _name_similarity(A[ka]["name"], B[kb]["name"])
            if name >= 0.6:
                pairs.append((name, _config_similarity(A[ka], B[kb]), _mix_similarity(A[ka], B[kb]), ka, kb))
    pairs.sort(reverse=True)
    taken_b = set()
    for name, config, mix, ka, kb in pairs:
        if ka in rows or kb in taken_b:
            continue
        rows[ka] = ("changed", kb)
        taken_b.add(kb)
    for ka in left_a:
        rows.setdefault(ka, ("missing", None))
    new = [kb for kb in left_b if kb not in taken_b]

    def resource(entry, field):
        value = entry.get(field) if entry else None
        return "?" if value is None else str(value)

    def pair(a, b, field):
        x = resource(a, field)
        y = resource(b, field) if b is not None else x
        return x if x == y else f"{x}->{y}"

    width = max(len(k) for k in list(A) + list(B)) + 2
    header = f"{'status':<10} {'kernel in A':<{width}} {'kernel in B':<{width}} {'regs':>9} {'spills':>9} " \
             f"{'instrs':>11} {'diff':>11}"
    print(header)
    print("-" * len(header))
    order = {"changed": 0, "missing": 1, "identical": 2}
    counts = Counter()
    diffs = []
    for ka in sorted(A, key=lambda k: (order[rows[k][0]], k)):
        status, kb = rows[ka]
        counts[status] += 1
        a, b = A[ka], B.get(kb) if kb else None
        diff = ""
        if status == "changed":
            added, removed = _diff_size(a["lines"], b["lines"])
            diff = f"+{added} -{removed}"
            diffs.append((ka, kb))
        spill_text = "?" if _spills(a) is None else str(_spills(a))
        if b is not None and _spills(b) != _spills(a):
            spill_text += f"->{'?' if _spills(b) is None else _spills(b)}"
        instrs = str(len([l for l in a["lines"] if not l.endswith(":")]))
        if b is not None and b["lines"] != a["lines"]:
            instrs += f"->{len([l for l in b['lines'] if not l.endswith(':')])}"
        print(f"{status:<10} {ka:<{width}} {(kb or '-'):<{width}} {pair(a, b, 'registers'):>9} {spill_text:>9} "
              f"{instrs:>11} {diff:>11}")
    for status, keys in (("new", sorted(new)), ("duplicate", sorted(duplicates))):
        for kb in keys:
            b = B[kb]
            counts[status] += 1
            same = f"= {duplicates[kb]}" if status == "duplicate" else ""
            print(f"{status:<10} {same or '-':<{width}} {kb:<{width}} {resource(b, 'registers'):>9} {'':>9} "
                  f"{len([l for l in b['lines'] if not l.endswith(':')]):>11} {'':>11}")
    print(f"\n{dir_a}: {len(A)} kernels; {dir_b}: {len(B)} kernels")
    print(", ".join(f"{counts[s]} {s}" for s in ("identical", "changed", "missing", "new", "duplicate")))
    if show_diff:
        for ka, kb in diffs:
            print(f"\n--- {ka}\n+++ {kb}")
            for line in difflib.unified_diff(A[ka]["lines"], B[kb]["lines"], lineterm="", n=2):
                if not line.startswith(("---", "+++")):
                    print(line)
    return 0 if counts["changed"] == counts["missing"] == counts["new"] == counts["duplicate"] == 0 else 1


# ---------------------------------------------------------------------------------------


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m packed_kernels.bench.sass",
                                     description="Dump (--out) or compare (--compare) the sm_90 SASS of every default "
                                                 "kernel configuration, without a GPU.")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--out", metavar="DIR", help="capture the workload's kernels and write their SASS to DIR")
    mode.add_argument("--compare", nargs=2, metavar=("DIR_A", "DIR_B"), help="compare two --out folders")
    parser.add_argument("--only", nargs="+", choices=GROUPS, default=list(GROUPS), help="workload groups (--out)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel compilations (--out)")
    parser.add_argument("--diff", action="store_true", help="print the normalised diff of changed kernels (--compare)")
    args = parser.parse_args(argv)
    if args.compare:
        return compare(*args.compare, show_diff=args.diff)
    return capture(args.out, [g for g in GROUPS if g in args.only], max(1, args.jobs))


if __name__ == "__main__":
    if "--compare" not in sys.argv[1:] and os.environ.get("TRITON_INTERPRET") != "0":
        # The kernels must be decorated for compilation: Triton reads TRITON_INTERPRET when
        # it is imported and when each kernel is decorated, and importing packed_kernels
        # (which ``python -m`` has already done) sets it to 1 on a machine without a GPU.
        os.environ["TRITON_INTERPRET"] = "0"
        os.execv(sys.executable, [sys.executable, "-m", __spec__.name, *sys.argv[1:]])
    sys.exit(main())
