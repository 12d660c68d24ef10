"""``handles(model)``: the handles of this package's patches that act on a model, found from the
model itself (a copy's patches included)."""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from .registry import Handle

__all__ = ["handles"]


def modules_of(obj: Any) -> list[nn.Module]:
    """``obj``'s modules when it is a module, else those of the modules among its attributes (a
    trainer's ``model`` and ``ref_model``, a wrapper's ``module``)."""
    if isinstance(obj, nn.Module):
        return list(obj.modules())
    return [m for value in vars(obj).values() if isinstance(value, nn.Module) for m in value.modules()]


def handles(obj: Any) -> list[Handle]:
    """The active handles of the patches that act on ``obj`` (a model, or anything whose attributes
    hold one): :func:`~model_patches.enable_hidden_state_loss` on it or on a module inside it.

    A deep copy or an unpickled copy of a patched model has patches of its own; this returns their
    handles, and removing them leaves the original's in place (and the reverse). Process-wide
    patches (:func:`~model_patches.enable_packing`, :func:`~model_patches.enable_chunked_loss`,
    :func:`~model_patches.enable_trl_heads`) act on every model and are not listed here.
    """
    from .loss.hidden_state_loss import live_patches

    ids = {id(m) for m in modules_of(obj)}
    return [p.handle for p in live_patches() if id(p.model) in ids]
