"""One way from a public function to its kernels, for every algorithm of the package.

Each differentiable kernel pair is an :class:`Operator`: a ``torch.library`` custom op
under the namespace ``packed_kernels::``, with a fake (shape-only) implementation and a
registered autograd formula, *and* the same implementation and formula as a plain
``torch.autograd.Function``. A call takes one of the two:

* **eager** (the common case): the ``autograd.Function``, which costs the host less per
  call than the dispatcher's path through a custom op; where there is nothing to record
  (gradients off, as in inference and a backward that builds no graph, or no input
  that requires a gradient) the implementation itself;
* **under a** ``torch.func`` **transform** (``grad``, ``vjp``, ``vmap``, ``jvp``, ``jacrev``,
  ``jacfwd``, ``hessian``, ...): the same function in the form those transforms need (a
  separate ``setup_context``). ``torch.func.vmap`` takes the operator's vmap rule
  (:meth:`Operator.register_vmap`), forward-mode transforms (``jvp``, ``jacfwd``) its jvp
  rule (:meth:`Operator.register_jvp`); an operator without a vmap rule refuses ``vmap``
  with a clear error (the kernels take whole packed batches, not batched tensors), one
  without a jvp rule forward mode (PyTorch's error);
* **traced** (:func:`is_traced`: ``torch.compile`` and ``torch.export``, fake tensors and
  other dispatch modes, tensor subclasses, CUDA-graph capture): the custom op, which
  tracing keeps opaque and shape-checks through its fake implementation.

A backward formula calls other operators through :meth:`Operator.within`, so every
order of derivative of an eager call stays eager, and of a traced call stays custom ops.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode

__all__ = ["EAGER", "FUNCTIONAL", "NAMESPACE", "TRACED", "Operator", "call_mode", "is_traced", "operator"]

#: The ``torch.library`` namespace of every custom op of the package.
NAMESPACE = "packed_kernels"

# Subclasses that behave as plain tensors in eager mode: a module's parameters.
_PLAIN_TENSOR_TYPES = (Tensor, torch.nn.Parameter)


def is_traced(*args) -> bool:
    """Whether this call is being traced or captured rather than run eagerly.

    True while ``torch.compile`` or ``torch.export`` traces, under any dispatch mode
    (``FakeTensorMode``, the proxy modes of tracing), when an argument is a tensor
    subclass other than ``nn.Parameter`` (fake or functional tensors) or a ``meta``
    tensor (shapes only), and while a CUDA graph is captured. Such calls take the
    custom ops, and skip every check that reads tensor values on the host (a host read
    would break the graph, or is forbidden).
    """
    if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
        return True
    for a in args:
        if isinstance(a, Tensor) and (type(a) not in _PLAIN_TENSOR_TYPES or a.is_meta):
            return True
    # a capture needs CUDA initialised; asking that is cheaper than torch.cuda.is_available()
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


#: The three ways a call runs an :class:`Operator` (see the module docstring).
EAGER, FUNCTIONAL, TRACED = "eager", "functional", "traced"


def call_mode(*args) -> str:
    """:data:`FUNCTIONAL` under a ``torch.func`` transform, :data:`TRACED` where
    :func:`is_traced` holds, else :data:`EAGER`: the one decision a public function
    makes, then hands to every operator it calls (:meth:`Operator.run`)."""
    if torch._C._are_functorch_transforms_active():
        return FUNCTIONAL
    return TRACED if is_traced(*args) else EAGER


class Operator:
    """A custom op ``packed_kernels::<name>`` and its eager twin, one implementation.

    ``impl`` takes and returns tensors (its annotations are the op's schema).
    :meth:`register_fake` and :meth:`register_autograd` take what the
    ``torch.library`` functions of those names take; the autograd formula serves both
    paths. An operator without a registered formula is not differentiable.
    :meth:`register_vmap` and :meth:`register_jvp` give the ``torch.func`` form its
    ``vmap`` and forward-mode rules; without them ``vmap`` (and forward mode) is refused.
    """

    def __init__(self, name: str, impl: Callable):
        self.name = name
        self.qualified_name = f"{NAMESPACE}::{name}"
        self.impl = impl
        self.custom_op = torch.library.custom_op(self.qualified_name, mutates_args=())(impl)
        self._setup_context: Optional[Callable] = None
        self._backward: Optional[Callable] = None
        self._vmap_rule: Optional[Callable] = None
        self._jvp_rule: Optional[Callable] = None
        self._build()

    def _build(self):
        """The two ``autograd.Function`` s, from what has been registered so far."""
        impl, qualified_name = self.impl, self.qualified_name
        setup_context, backward = self._setup_context, self._backward
        vmap_rule, jvp_rule = self._vmap_rule, self._jvp_rule

        def forward(ctx, *inputs):
            # the ctx-taking form: a separate setup_context would make every call bind
            # its arguments through inspect.signature
            output = impl(*inputs)
            if setup_context is not None:
                setup_context(ctx, inputs, output)
            ctx.eager = True
            return output

        def no_gradient(ctx, *grads):
            raise RuntimeError(f"{qualified_name} has no gradient formula")

        backward = backward if backward is not None else no_gradient
        self.eager = type(f"Eager_{self.name}", (torch.autograd.Function,), {
            "forward": staticmethod(forward), "backward": staticmethod(backward)})

        def setup(ctx, inputs, output):
            if setup_context is not None:
                setup_context(ctx, inputs, output)
            ctx.eager = True
            if jvp_rule is not None:
                # what the jvp rule reads: the tensor arguments and outputs (PyTorch drops
                # them once the forward-mode pass is done), and the other arguments
                outputs = output if isinstance(output, tuple) else (output,)
                ctx.save_for_forward(*(a if isinstance(a, Tensor) else None for a in inputs), *outputs)
                ctx.jvp_arguments = tuple(None if isinstance(a, Tensor) else a for a in inputs)
                ctx.jvp_tuple_output = isinstance(output, tuple)

        if vmap_rule is not None:
            vmap = vmap_rule
        else:
            def vmap(info, in_dims, *args):
                raise NotImplementedError(
                    f"{qualified_name} does not support torch.func.vmap: its kernels take whole packed "
                    "batches; fold the mapped dimension into the packed (first) dimension instead")

        # torch.func transforms need the forward without ctx and a separate setup_context
        methods = {"forward": staticmethod(impl), "setup_context": staticmethod(setup),
                   "backward": staticmethod(backward), "vmap": staticmethod(vmap)}
        if jvp_rule is not None:
            def jvp(ctx, *tangents):
                saved = ctx.saved_tensors
                n = len(ctx.jvp_arguments)
                inputs = tuple(a if s is None else s for s, a in zip(saved[:n], ctx.jvp_arguments))
                output = tuple(saved[n:]) if ctx.jvp_tuple_output else saved[n]
                return _below_jvp_level(jvp_rule, inputs, output, tangents)

            methods["jvp"] = staticmethod(jvp)
        self.functional = type(f"Functional_{self.name}", (torch.autograd.Function,), methods)

    def register_fake(self, fake: Callable) -> Callable:
        return self.custom_op.register_fake(fake)

    def register_autograd(self, backward: Callable, *, setup_context: Callable) -> None:
        self.custom_op.register_autograd(backward, setup_context=setup_context)
        self._setup_context, self._backward = setup_context, backward
        self._build()

    def register_vmap(self, rule: Callable) -> Callable:
        """``rule(info, in_dims, *args) -> (output, out_dims)``: the operator under
        ``torch.func.vmap``, as an ``autograd.Function``'s ``vmap`` staticmethod takes it
        (``args`` without the mapped level, ``in_dims`` where each one's mapped dimension
        is, ``None`` where it has none; ``info.batch_size``). It runs one level below the
        ``vmap`` and calls operators as usual (``op(...)``), so that the transforms below
        it see them. Usable as a decorator; returns ``rule``."""
        self._vmap_rule = rule
        self._build()
        return rule

    def register_jvp(self, rule: Callable) -> Callable:
        """``rule(inputs, output, *tangents) -> output tangent(s)``: the operator's
        forward-mode derivative (``torch.func.jvp``, ``jacfwd``, ``hessian``), with the
        forward's arguments and output and one tangent per argument (``None`` where an
        argument has none; ``None`` for an output that is not differentiable). It calls
        operators as usual, so that it is itself differentiable and vmappable. Usable as a
        decorator; returns ``rule``."""
        self._jvp_rule = rule
        self._build()
        return rule

    def __call__(self, *args):
        return self.run(call_mode(*args), *args)

    def run(self, mode: str, *args):
        """The operator as ``mode`` (from :func:`call_mode`) runs it."""
        if mode is FUNCTIONAL:
            return self.functional.apply(*args)
        if mode is TRACED:
            return self.custom_op(*args)
        if torch.is_grad_enabled():
            for a in args:
                if isinstance(a, Tensor) and a.requires_grad:
                    return self.eager.apply(*args)
        # nothing for autograd to record: the implementation alone, without the Function's
        # bookkeeping (inference, index tensors, a backward that builds no graph)
        return self.impl(*args)

    def within(self, ctx) -> Callable:
        """The operator as a backward formula calls it: inside an eager backward, the eager
        call (the ``autograd.Function`` where the backward builds a graph, else the
        implementation); inside the custom op's backward, the custom op (what tracing sees)."""
        return self.__call__ if getattr(ctx, "eager", False) else self.custom_op


def _below_jvp_level(rule: Callable, inputs: tuple, output, tangents: tuple):
    """``rule(inputs, output, *tangents)`` one level below the ``torch.func.jvp`` that asks
    for it, as the forward of an ``autograd.Function`` runs under that transform.

    PyTorch runs an ``autograd.Function``'s ``jvp`` at the transform's own level with
    forward-mode gradients off, so that an outer ``jvp`` (``jacfwd`` of ``jacfwd``) does
    not see the rule's PyTorch operations and drops their derivative (a silently wrong
    second derivative: pytorch/pytorch#197867). Here the arguments, output and tangents
    lose the level's wrapper, the rule runs with that level popped and forward-mode
    gradients on (the outer levels see every operation), and the tangents it returns
    are wrapped for the level again."""
    from torch._C._functorch import TransformType, _unwrap_for_grad, _wrap_for_grad
    from torch._functorch.pyfunctorch import retrieve_current_functorch_interpreter
    from torch.autograd.forward_ad import _set_fwd_grad_enabled

    if not torch._C._are_functorch_transforms_active():
        return rule(inputs, output, *tangents)
    interpreter = retrieve_current_functorch_interpreter()
    if interpreter.key() != TransformType.Jvp:
        return rule(inputs, output, *tangents)
    level = interpreter.level()

    def unwrap(value):
        return _unwrap_for_grad(value, level) if isinstance(value, Tensor) else value

    def wrap(value):
        return _wrap_for_grad(value, level) if isinstance(value, Tensor) else value

    output = tuple(map(unwrap, output)) if isinstance(output, tuple) else unwrap(output)
    with torch.enable_grad(), _set_fwd_grad_enabled(True), interpreter.lower():
        result = rule(tuple(map(unwrap, inputs)), output, *map(unwrap, tangents))
    return tuple(map(wrap, result)) if isinstance(result, tuple) else wrap(result)


def operator(name: str) -> Callable[[Callable], Operator]:
    """Decorator form: ``@operator("segment_sum")`` above the implementation."""
    return lambda impl: Operator(name, impl)
