"""One way from a public function to its kernels, for every algorithm of the package.

Each differentiable kernel pair is an :class:`Operator`: a ``torch.library`` custom op
under the namespace ``packed_kernels::``, with a fake (shape-only) implementation and a
registered autograd formula, *and* the same implementation and formula as a plain
``torch.autograd.Function``. A call takes one of the two:

* **eager** (the common case): the ``autograd.Function``, which costs the host less per
  call than the dispatcher's path through a custom op; where there is nothing to record
  (gradients off, as in inference and a backward that builds no graph, or no input
  that requires a gradient) the implementation itself;
* **under a** ``torch.func`` **transform** (``grad``, ``vjp``, ``jacrev``, ...): the same
  function in the form those transforms need (a separate ``setup_context``).
  ``torch.func.vmap`` is refused with a clear error: the kernels take whole packed
  batches, so fold the extra batch dimension into the packed one instead;
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
    """

    def __init__(self, name: str, impl: Callable):
        self.name = name
        self.qualified_name = f"{NAMESPACE}::{name}"
        self.impl = impl
        self.custom_op = torch.library.custom_op(self.qualified_name, mutates_args=())(impl)
        self._build_eager(None, None)

    def _build_eager(self, setup_context: Optional[Callable], backward: Optional[Callable]):
        impl, qualified_name = self.impl, self.qualified_name

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

        def vmap(info, in_dims, *args):
            raise NotImplementedError(
                f"{qualified_name} does not support torch.func.vmap: its kernels take whole packed "
                "batches; fold the mapped dimension into the packed (first) dimension instead")

        # torch.func transforms need the forward without ctx and a separate setup_context
        self.functional = type(f"Functional_{self.name}", (torch.autograd.Function,), {
            "forward": staticmethod(impl), "setup_context": staticmethod(setup),
            "backward": staticmethod(backward), "vmap": staticmethod(vmap)})

    def register_fake(self, fake: Callable) -> Callable:
        return self.custom_op.register_fake(fake)

    def register_autograd(self, backward: Callable, *, setup_context: Callable) -> None:
        self.custom_op.register_autograd(backward, setup_context=setup_context)
        self._build_eager(setup_context, backward)

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


def operator(name: str) -> Callable[[Callable], Operator]:
    """Decorator form: ``@operator("segment_sum")`` above the implementation."""
    return lambda impl: Operator(name, impl)
