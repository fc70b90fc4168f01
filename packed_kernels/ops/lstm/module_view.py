"""How :class:`~packed_kernels.ops.lstm.PersistentLSTM` reads the ``nn.LSTM`` it wraps.

Dynamo refuses to trace an ``nn.LSTM`` object (unless ``torch._dynamo.config.allow_rnn``),
even to read one of its attributes. The kernels' path never needs the object: it reads
the module's attributes, mode and parameters, which all live in the module's own
dictionaries. :class:`ModuleView` reads them there, at every call, so that a compiled
call traces the view (with a guard on each value it reads) and an eager one sees every
change made to the module after wrapping.
"""
from __future__ import annotations

from typing import List, Tuple

import torch

from .triton_kernels import MAX_HIDDEN

__all__ = ["PARAMETER_DTYPES", "ModuleView", "check_lstm", "check_supported"]

#: The parameter dtypes the kernels run (all parameters of a module in one of them).
PARAMETER_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class ModuleView:
    """The attributes and parameters of an ``nn.LSTM``, read where the module keeps them.

    ``view.hidden_size``, ``view.training`` and ``view.weight_hh_l0`` are what
    ``lstm.hidden_size``, ``lstm.training`` and ``lstm.weight_hh_l0`` are at the moment
    they are read: the view holds the module's ``__dict__`` (its attributes, its mode,
    and the ``_parameters`` dictionary every assignment, load or conversion of a
    parameter writes into), not copies. A changed attribute, ``lstm.eval()``, a replaced
    or loaded parameter and an in-place change through ``.data`` are all seen. A name
    neither dictionary holds (a parametrization's computed weight, a class attribute) is
    read from the module itself, which Dynamo refuses to trace.

    The view never reads the module object on the kernels' path; it keeps it only so
    that a copy or a pickle of the view views the copy of the module.
    """

    def __init__(self, lstm: torch.nn.Module):
        self._module = lstm
        self._attributes = vars(lstm)

    def __getattr__(self, name: str):
        if name.startswith("__") or name in ("_module", "_attributes"):
            raise AttributeError(name)  # the copy and pickle protocols, and a view being rebuilt
        attributes = self._attributes
        if name in attributes:
            return attributes[name]
        parameters = attributes["_parameters"]
        if name in parameters:
            return parameters[name]
        return getattr(self._module, name)

    def __reduce__(self):
        # a copied module has a new __dict__: the copy's view must read that one
        return ModuleView, (self._module,)

    def named_parameters(self) -> List[Tuple[str, torch.Tensor]]:
        """The module's own parameters, ``(name, tensor)`` in registration order (what
        ``lstm.named_parameters()`` gives for an ``nn.LSTM``)."""
        return [(name, p) for name, p in self._attributes["_parameters"].items() if p is not None]

    def parameters(self) -> List[torch.Tensor]:
        return [p for _, p in self.named_parameters()]


def check_lstm(lstm) -> None:
    """``lstm`` is an ``nn.LSTM`` the kernels run (:func:`check_supported`); else a
    ``TypeError`` or ``ValueError`` naming what is not."""
    if not isinstance(lstm, torch.nn.LSTM):
        raise TypeError(f"lstm must be a torch.nn.LSTM; got {type(lstm).__name__}")
    check_supported(lstm)


def check_supported(lstm) -> None:
    """The properties of the module (an ``nn.LSTM`` or a :class:`ModuleView` of one) that
    may change after wrapping, checked at every call: no projections, a hidden size whose
    recurrent weights fit on chip, every parameter of one of :data:`PARAMETER_DTYPES`."""
    if lstm.proj_size > 0:
        raise ValueError(f"nn.LSTM with proj_size={lstm.proj_size} (projections) is not supported; need proj_size=0")
    if lstm.hidden_size > MAX_HIDDEN:
        raise ValueError(
            f"nn.LSTM with hidden_size={lstm.hidden_size} is not supported: the kernels keep the recurrent "
            f"weights on chip, which allows hidden_size up to {MAX_HIDDEN}"
        )
    named = list(lstm.named_parameters())
    first_name, first = named[0]
    for name, p in named:
        if p.dtype not in PARAMETER_DTYPES:
            raise TypeError(f"the nn.LSTM's parameters must be float32, float16 or bfloat16; got {name} of dtype "
                            f"{p.dtype}")
        if p.dtype != first.dtype:
            raise TypeError(f"the nn.LSTM's parameters must all have one dtype; got {first_name} of dtype "
                            f"{first.dtype} and {name} of dtype {p.dtype}")
