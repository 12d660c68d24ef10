"""The instance-forward swap: a patch on one module sets ``module.forward`` (an instance attribute,
so the module's type, children and ``state_dict`` keys stay as they were) and its undo puts back
what was there, or takes the patch out from under code that wrapped it since."""

from __future__ import annotations

import types
from typing import Any, Callable, Optional

from torch import nn

from .unwrap import holder_of

__all__ = ["swap_forward", "restore_forward", "forward_below", "wrapped_forward"]


def swap_forward(module: nn.Module, replacement: Callable[..., Any]) -> Optional[Callable[..., Any]]:
    """Install ``replacement`` as ``module``'s instance ``forward``; return the instance forward it
    replaced (None when the class's forward was in use)."""
    previous = module.__dict__.get("forward")
    module.__dict__["forward"] = replacement
    return previous


def forward_below(module: nn.Module, previous: Optional[Callable[..., Any]]) -> Callable[..., Any]:
    """What a swapped-in forward calls: ``previous``, else the class's forward bound to ``module``."""
    return previous if previous is not None else types.MethodType(type(module).forward, module)


def wrapped_forward(module: nn.Module, replacement: Any) -> Optional[Callable[[Any], None]]:
    """None when ``module``'s forward is ``replacement`` itself; else where the code installed
    since holds ``replacement`` (see :func:`patch_layer.unwrap.holder_of`), or raises LookupError
    when it cannot be found."""
    top = module.__dict__.get("forward")
    if top is replacement:
        return None
    repoint = holder_of(top, replacement)
    if repoint is None:
        raise LookupError(top)
    return repoint


def restore_forward(module: nn.Module, replacement: Any, previous: Optional[Callable[..., Any]]) -> bool:
    """Undo :func:`swap_forward`: put ``previous`` back (or the class's forward), or, when code
    installed since wrapped ``replacement``, re-point that code at what ``replacement`` wrapped and
    also every attribute of ``module`` that names ``replacement`` (Accelerate keeps the forward it
    wrapped as ``_original_forward``). Returns True when it unwrapped from under later code.

    Call :func:`wrapped_forward` first (a handle's ``_check``): this assumes it did not raise.
    """
    repoint = wrapped_forward(module, replacement)
    if repoint is None:
        if previous is None:
            module.__dict__.pop("forward", None)
        else:
            module.__dict__["forward"] = previous
        return False
    below = forward_below(module, previous)
    repoint(below)
    for name, value in list(vars(module).items()):
        if value is replacement:
            setattr(module, name, below)
    return True
