"""``torch.func.vmap`` over the segment operations, and the transforms made of it
(``jacrev``, ``jacfwd``, ``hessian``), to second order.

Each operator's vmap rule folds the mapped dimension into the one launch of its kernel
(into the columns, or for ``rms`` and ``matvec`` into the rows), so a vmapped call runs
as many kernels as one example does; it must give the stack of the per-example calls,
with the same first and second derivatives. ``idx`` (one set of segments per call) is
never batched, and an operator without a vmap rule still refuses vmap clearly."""
import re

import pytest
import torch

import packed_kernels as pk
from packed_kernels.dispatch import Operator
from packed_kernels.ops.segment import api
from packed_kernels.ops.segment import triton_kernels as tk

from assertions import assert_close
from segment_cases import LAUNCHERS, make_idx

#: The examples of a batch.
B = 3
#: Segments of 3, 0, 4 and 2 rows, and an empty one at the end.
LENGTHS = [3, 0, 4, 2]
S = len(LENGTHS) + 1

FUNCTIONS = {"sum": pk.segmented_sum, "sum-1d": pk.segmented_sum, "mean": pk.segmented_mean,
             "rms_norm": pk.segmented_rms_norm, "dot": pk.segmented_dot, "dot-1d": pk.segmented_dot,
             "mul": pk.segmented_mul, "mul_broadcast": pk.segmented_mul, "mul-1d": pk.segmented_mul,
             "matvec": pk.segmented_matvec}


def example_shapes(op, n_rows):
    """The shape of each tensor argument of one example of ``op``."""
    return {"sum": [(n_rows, 3)], "sum-1d": [(n_rows,)], "mean": [(n_rows, 3)], "rms_norm": [(n_rows, 3)],
            "dot": [(n_rows, 3)] * 2, "dot-1d": [(n_rows,)] * 2, "mul": [(n_rows, 3), (S, 3)],
            "mul_broadcast": [(n_rows, 3), (S,)], "mul-1d": [(n_rows,), (S,)],
            "matvec": [(n_rows, 3), (S, 3, 2)]}[op]


def _batched_cases():
    """Every operation with every combination of its batched tensor arguments."""
    cases = []
    for op in FUNCTIONS:
        if len(example_shapes(op, 1)) == 1:
            cases.append((op, (True,)))
        else:
            cases += [(op, (True, False)), (op, (False, True)), (op, (True, True))]
    return cases


def _case_id(op, batched):
    names = ("v", "m") if op == "matvec" else ("x", "y")
    return f"{op}-" + "+".join(n for n, b in zip(names, batched) if b)


#: ``in_dims`` 0 and ``out_dims`` 0; or the mapped dimension last in every batched
#: input and second in the output.
LAYOUTS = ["dims0", "last-in-out1"]

CASES = [pytest.param(op, batched, layout, id=f"{_case_id(op, batched)}-{layout}")
         for op, batched in _batched_cases() for layout in LAYOUTS]


def _leaves(op, batched, layout, idx, device, seed=3):
    """The tensor arguments (the batched ones with B examples along their ``in_dim``) and
    the ``in_dims`` and ``out_dims`` of the vmap."""
    gen = torch.Generator().manual_seed(seed)
    leaves, in_dims = [], []
    for shape, is_batched in zip(example_shapes(op, idx.shape[0]), batched):
        if not is_batched:
            leaves.append(torch.randn(shape, generator=gen, dtype=torch.float64).to(device))
            in_dims.append(None)
            continue
        dim = 0 if layout == "dims0" else len(shape)
        examples = [torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(B)]
        leaves.append(torch.stack(examples, dim=dim).to(device))
        in_dims.append(dim)
    return leaves, tuple(in_dims), 0 if layout == "dims0" else 1


def _vmapped(op, idx, in_dims, out_dims):
    return torch.func.vmap(lambda *args: FUNCTIONS[op](*args, idx, S), in_dims=in_dims, out_dims=out_dims)


def _loop(op, idx, in_dims, out_dims):
    """The reference: ``op`` once per example, stacked along ``out_dims``."""
    def call(*args):
        return torch.stack([FUNCTIONS[op](*(a if d is None else a.select(d, b) for a, d in zip(args, in_dims)), idx, S)
                            for b in range(B)], dim=out_dims)
    return call


def output_and_derivatives(fn, leaves):
    """``fn``'s output, the gradient of ``sum(out^2)`` with respect to every leaf, and the
    gradient of the squared norm of that gradient (second order), by autograd."""
    leaves = [t.detach().clone().requires_grad_() for t in leaves]
    out = fn(*leaves)
    firsts = torch.autograd.grad(out.square().sum(), leaves, create_graph=True)
    seconds = torch.autograd.grad(sum(f.square().sum() for f in firsts), leaves)
    return [out.detach(), *(f.detach() for f in firsts), *seconds]


class _Launches:
    """Counts the segment kernels launched (each launcher replaced by a counting one)."""

    def __init__(self, monkeypatch):
        self.count = 0
        for name in LAUNCHERS:
            monkeypatch.setattr(tk, name, self._counting(getattr(tk, name)))

    def _counting(self, launcher):
        def launch(*args, **kwargs):
            self.count += 1
            return launcher(*args, **kwargs)
        return launch

    def of(self, fn, *args):
        before = self.count
        with torch.no_grad():
            fn(*args)
        return self.count - before


# --- each operation, each batched argument: vmap against a loop -------------------------------

@pytest.mark.parametrize("op, batched, layout", CASES)
def test_vmap_matches_a_loop_to_second_order(op, batched, layout, device, monkeypatch):
    """``vmap`` of each operation, over every combination of its batched arguments (an
    unbatched one shared by every example), gives the stack of the per-example calls,
    with the same first and second derivatives (autograd through the vmapped call) for
    every argument; and the batch runs as many kernels as one example (one launch per
    operator: the mapped dimension folds into the kernel's columns or rows)."""
    idx = make_idx(LENGTHS, device)
    leaves, in_dims, out_dims = _leaves(op, batched, layout, idx, device)
    got = output_and_derivatives(_vmapped(op, idx, in_dims, out_dims), leaves)
    want = output_and_derivatives(_loop(op, idx, in_dims, out_dims), leaves)
    labels = ["output"] + [f"d/d{k}" for k in range(len(leaves))] + [f"d2/d{k}" for k in range(len(leaves))]
    for label, a, b in zip(labels, got, want):
        assert_close(f"{op} vmapped {label}", a, b, atol=1e-12, rtol=1e-12)

    launches = _Launches(monkeypatch)
    one = [t if d is None else t.select(d, 0) for t, d in zip(leaves, in_dims)]
    assert launches.of(_vmapped(op, idx, in_dims, out_dims), *leaves) == launches.of(
        lambda *args: FUNCTIONS[op](*args, idx, S), *one)


def _per_example_derivatives(op, idx, n_args):
    """``grad`` of ``sum(out^2)`` for every argument, and ``grad`` of that gradient's squared
    norm (second order): the backward formulas run on what ``vmap`` maps."""
    argnums = tuple(range(n_args))

    def loss(*args):
        return FUNCTIONS[op](*args, idx, S).square().sum()

    def gradient_norm(*args):
        return sum(g.square().sum() for g in torch.func.grad(loss, argnums)(*args))

    return {"grad": torch.func.grad(loss, argnums), "grad of grad": torch.func.grad(gradient_norm, argnums)}


def _vmap_against_loop(label, fn, leaves, in_dims):
    got = torch.func.vmap(fn, in_dims=in_dims)(*leaves)
    per_example = [fn(*(a if d is None else a.select(d, b) for a, d in zip(leaves, in_dims))) for b in range(B)]
    for k, (a, parts) in enumerate(zip(got, zip(*per_example))):
        assert_close(f"{label}, argument {k}", a, torch.stack(parts), atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("op, batched", [pytest.param(op, batched, id=_case_id(op, batched))
                                         for op, batched in _batched_cases()])
def test_vmap_of_grad_matches_a_loop_to_second_order(op, batched, device):
    """``vmap`` of ``torch.func.grad`` (per-example gradients, for every argument, batched
    or not) and of ``grad`` of that gradient's squared norm: the backward formulas'
    operators (``gather``, ``gather_over_count``, ``scale_rows``, ``dot``, ``rms_backward``
    and its double backward, ``matvec`` both ways and ``outer``) under ``vmap``, against
    the loop over the examples."""
    idx = make_idx(LENGTHS, device)
    leaves, in_dims, _ = _leaves(op, batched, "dims0", idx, device, seed=8)
    for name, fn in _per_example_derivatives(op, idx, len(leaves)).items():
        _vmap_against_loop(f"{op} vmap of {name}", fn, leaves, in_dims)


@pytest.mark.parametrize("op", ["sum", "mean", "dot", "mul", "rms_norm", "matvec"])
def test_vmap_over_each_argument_of_the_input_tables(op, device):
    """What the bad-input tables of ``test_segment_inputs`` once expected to be refused
    (each tensor argument but ``idx`` batched by ``vmap``, and ``vmap`` of ``grad`` over
    the rows) runs: the stack of the unbatched calls, and of their gradients."""
    gen = torch.Generator().manual_seed(12)
    rand = lambda *shape: torch.randn(shape, generator=gen, dtype=torch.float64).to(device)  # noqa: E731
    idx = make_idx([2, 3], device)
    names = {"dot": ("x", "y"), "mul": ("x", "y"), "matvec": ("v", "m")}.get(op, ("x",))
    arguments = {names[0]: rand(5, 3)}
    if len(names) == 2:
        arguments[names[1]] = {"dot": rand(5, 3), "mul": rand(2, 3), "matvec": rand(2, 3, 4)}[op]
    function = FUNCTIONS[op]
    for name in names:
        others = {k: v for k, v in arguments.items() if k != name}
        batch = torch.stack([arguments[name], 2 * arguments[name]])
        got = torch.func.vmap(lambda t: function(**others, **{name: t}, idx=idx, num_segments=2))(batch)
        want = torch.stack([function(**others, **{name: t}, idx=idx, num_segments=2) for t in batch])
        assert_close(f"{op} vmapped over {name}", got, want, atol=1e-12, rtol=1e-12)

    rows, others = names[0], {k: v for k, v in arguments.items() if k != names[0]}

    def loss(t):
        return function(**others, **{rows: t}, idx=idx, num_segments=2).square().sum()

    batch = torch.stack([arguments[rows], -arguments[rows]])
    got = torch.func.vmap(torch.func.grad(loss))(batch)
    want = torch.stack([torch.func.grad(loss)(t) for t in batch])
    assert_close(f"{op} vmap of grad", got, want, atol=1e-12, rtol=1e-12)


# --- a potential's Hessian ------------------------------------------------------------------

def _potential(device, lengths=LENGTHS):
    """A small molecular potential of positions ``(N, 3)`` in molecules of ``lengths``
    atoms (and an empty one at the end), and of one ``(3, 3)`` cell per molecule (by
    default fixed ones): with the segment operations, and the same with ``index_add`` and
    counts in float64, the reference."""
    idx = make_idx(lengths, device)
    rows = idx.long()
    S = len(lengths) + 1
    gen = torch.Generator().manual_seed(7)
    cells = torch.randn(S, 3, 3, generator=gen, dtype=torch.float64).to(device)
    counts = torch.tensor(lengths + [0], dtype=torch.float64, device=device)
    safe_counts = counts.clamp(min=1)

    def energy(pos, cells=cells):
        centre = pk.segmented_mean(pos, idx, S)
        rel = pos - centre[rows]
        spread = pk.segmented_sum((pos * pos).sum(-1), idx, S)
        size = pk.segmented_rms_norm(rel, idx, S)
        twist = pk.segmented_dot(pos, torch.sin(pos), idx, S)
        scaled = pk.segmented_mul(rel, size, idx, S)
        turned = pk.segmented_matvec(pos, cells, idx, S)
        return (spread.square().sum() + size.sum() + twist.sum() + (scaled * pos).sum()
                + 0.1 * turned.square().sum())

    def per_segment(values):
        return torch.zeros((S,) + values.shape[1:], dtype=values.dtype, device=device).index_add(0, rows, values)

    def reference(pos, cells=cells):
        centre = per_segment(pos) / safe_counts[:, None]
        rel = pos - centre[rows]
        spread = per_segment((pos * pos).sum(-1))
        mean_square = torch.where(counts > 0, per_segment((rel * rel).sum(-1)) / safe_counts, 1.0)
        size = torch.where(counts > 0, mean_square.sqrt(), 0.0)
        twist = per_segment((pos * torch.sin(pos)).sum(-1))
        scaled = rel * size[rows][:, None]
        turned = torch.einsum("ij,ijk->ik", pos, cells[rows])
        return (spread.square().sum() + size.sum() + twist.sum() + (scaled * pos).sum()
                + 0.1 * turned.square().sum())

    pos = torch.randn(idx.shape[0], 3, generator=gen, dtype=torch.float64).to(device)
    return energy, reference, pos, cells


HESSIANS = {
    "jacrev(grad)": lambda f: torch.func.jacrev(torch.func.grad(f)),
    "hessian": torch.func.hessian,  # jacfwd of jacrev: forward mode over reverse
    "jacrev(jacrev)": lambda f: torch.func.jacrev(torch.func.jacrev(f)),
    "jacrev(jacfwd)": lambda f: torch.func.jacrev(torch.func.jacfwd(f)),
    "jacfwd(jacfwd)": lambda f: torch.func.jacfwd(torch.func.jacfwd(f)),
}

#: Fewer atoms where the transform runs over reverse mode's tangents: Triton's
#: interpreter scans the (N*3)**2 folded columns slowly.
_SMALLER = {"jacrev(jacfwd)": [2, 0, 3], "jacfwd(jacfwd)": [2, 0, 2]}


@pytest.mark.parametrize("transform", list(HESSIANS))
def test_hessian_of_a_potential(transform, device):
    """The Hessian of a potential made of all six operations, by ``torch.func`` (reverse
    and forward mode, each over the other and itself), against
    ``torch.autograd.functional.hessian`` of the same potential with ``index_add``."""
    energy, reference, pos, _ = _potential(device, _SMALLER.get(transform, LENGTHS))
    want = torch.autograd.functional.hessian(reference, pos)
    got = HESSIANS[transform](energy)(pos)
    assert_close(f"{transform} of the potential", got, want, atol=1e-11, rtol=1e-11)


def test_derivative_of_the_forces_with_respect_to_the_cells(device):
    """The mixed second derivative ``d/dcells`` of the forces ``-dE/dpos`` (``jacrev`` and
    ``jacfwd`` over ``grad``: ``matvec`` and ``outer`` with either operand batched),
    against ``torch.autograd.functional.hessian`` of the reference."""
    energy, reference, pos, cells = _potential(device)
    want = torch.autograd.functional.hessian(reference, (pos, cells))[0][1]
    forces = torch.func.grad(energy, argnums=0)
    for name, jacobian in (("jacrev", torch.func.jacrev), ("jacfwd", torch.func.jacfwd)):
        assert_close(f"{name} of the forces by the cells", jacobian(forces, argnums=1)(pos, cells), want,
                     atol=1e-11, rtol=1e-11)


def test_vmap_and_grad_compose(device):
    """``vmap`` of ``grad`` (per-example forces), ``grad`` of ``vmap``, ``vmap`` of ``vmap``
    and ``vmap`` of ``jvp``, against loops over the examples."""
    energy, reference, pos, _ = _potential(device)
    batch = torch.stack([pos, pos.flip(0), 0.5 * pos])
    forces = torch.stack([torch.func.grad(reference)(p) for p in batch])
    assert_close("vmap(grad)", torch.func.vmap(torch.func.grad(energy))(batch), forces, atol=1e-11, rtol=1e-11)
    assert_close("grad(vmap)", torch.func.grad(lambda b: torch.func.vmap(energy)(b).sum())(batch), forces,
                 atol=1e-11, rtol=1e-11)
    nested = torch.func.vmap(torch.func.vmap(energy))(torch.stack([batch, batch.flip(0)]))
    energies = torch.stack([reference(p) for p in batch])
    assert_close("vmap(vmap)", nested, torch.stack([energies, energies.flip(0)]), atol=1e-11, rtol=1e-11)
    tangent = torch.ones_like(pos)
    slopes = torch.func.vmap(lambda p: torch.func.jvp(energy, (p,), (tangent,))[1])(batch)
    assert_close("vmap(jvp)", slopes, (forces * tangent).sum((1, 2)), atol=1e-11, rtol=1e-11)


# --- the loop fallback ------------------------------------------------------------------------

@pytest.mark.parametrize("op, batched", [("rms_norm", (True,)), ("matvec", (True, False)),
                                         ("matvec", (True, True))], ids=["rms_norm", "matvec-v", "matvec-v+m"])
def test_loop_fallback_where_the_rows_would_not_fit(op, batched, device, monkeypatch):
    """Where a fold into the rows would count ``2**31`` or more rows or segments, the rule
    calls the operator once per example instead (here with the limit lowered so that
    every such fold loops: ``rms``, ``rms_backward`` and its double backward, ``matvec``
    with ``v`` batched, ``outer`` with both operands batched): the same results and
    derivatives, by autograd through the vmapped call and by ``vmap`` of ``grad``, and
    one launch per example."""
    idx = make_idx(LENGTHS, device)
    leaves, in_dims, out_dims = _leaves(op, batched, "dims0", idx, device, seed=5)
    per_example = _per_example_derivatives(op, idx, len(leaves))

    def everything():
        results = output_and_derivatives(_vmapped(op, idx, in_dims, out_dims), leaves)
        for fn in per_example.values():
            results += list(torch.func.vmap(fn, in_dims=in_dims)(*leaves))
        return results

    want = everything()
    launches = _Launches(monkeypatch)
    folded = launches.of(_vmapped(op, idx, in_dims, out_dims), *leaves)
    monkeypatch.setattr(api, "_FOLD_LIMIT", 1)
    for k, (a, b) in enumerate(zip(everything(), want)):
        assert_close(f"{op} looped, result {k}", a, b, atol=1e-12, rtol=1e-12)
    assert launches.of(_vmapped(op, idx, in_dims, out_dims), *leaves) == B * folded


# --- what vmap refuses ------------------------------------------------------------------------

@pytest.mark.parametrize("op", ["sum", "mean", "dot", "mul", "rms_norm", "matvec"])
def test_batched_idx_is_refused(op, device):
    """A batched ``idx`` (segments that differ by example) is refused by the public
    functions with an error that names it."""
    idx = make_idx([2, 3], device)
    x = torch.randn(5, 3, dtype=torch.float64, device=device)
    second = {"dot": x, "mul": x[:2], "matvec": torch.randn(2, 3, 2, dtype=torch.float64, device=device)}
    args = (x, second[op]) if op in second else (x,)
    with pytest.raises(NotImplementedError, match=re.escape("idx is batched by torch.func.vmap")):
        torch.func.vmap(lambda i: FUNCTIONS[op](*args, i, 2))(torch.stack([idx, idx]))


def test_operators_refuse_batched_segments(device):
    """Called directly, the operators refuse a batched ``idx`` or ``counts`` by name, and so
    does the ``idx`` check."""
    idx = make_idx([2, 3], device)
    x = torch.randn(5, 3, dtype=torch.float64, device=device)
    _, counts = api.segment_mean_op(x, idx, 2, True, None)
    idx_batch, counts_batch = torch.stack([idx, idx]), torch.stack([counts, counts])
    with pytest.raises(NotImplementedError, match=re.escape("idx is batched by torch.func.vmap")):
        torch.func.vmap(lambda i: api.segment_sum_op(x, i, 2, None))(idx_batch)
    with pytest.raises(NotImplementedError, match=re.escape("idx is batched by torch.func.vmap")):
        torch.func.vmap(lambda i, t: api.segment_sum_op(t, i, 2, None))(idx_batch, torch.stack([x, x]))
    with pytest.raises(NotImplementedError, match=re.escape("counts is batched by torch.func.vmap")):
        torch.func.vmap(lambda c: api.segment_gather_over_count_op(x[:2], idx, c, None))(counts_batch)
    codes = [c.code for c in api._idx_checks("segmented_sum")]
    with pytest.raises(NotImplementedError, match=re.escape("idx is batched by torch.func.vmap")):
        torch.func.vmap(lambda i: api.segment_check_idx_op(i, 2, *codes))(idx_batch)


def _double(x: torch.Tensor) -> torch.Tensor:
    return 2 * x


#: An operator without a vmap rule (nor a gradient formula).
_WITHOUT_RULE = Operator("test_segment_vmap_without_rule", _double)
_WITHOUT_RULE.register_fake(lambda x: torch.empty_like(x))


def test_an_operator_without_a_vmap_rule_still_refuses_vmap():
    x = torch.randn(2, 3, dtype=torch.float64)
    assert torch.equal(_WITHOUT_RULE(x), 2 * x)
    with pytest.raises(NotImplementedError, match=re.escape(
            "packed_kernels::test_segment_vmap_without_rule does not support torch.func.vmap")):
        torch.func.vmap(_WITHOUT_RULE)(x)
