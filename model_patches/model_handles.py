"""``handles(model)``: the handles of this package's patches that act on a model, found from the
model itself (a copy's patches included).

A patch that acts on one model records its handle in the patch layer's ledger
(:func:`patch_layer.track`), keyed weakly by the model: the entry goes with the model, and a
removed handle is no longer listed.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from patch_layer import Handle, tracked

__all__ = ["handles", "modules_of"]


def modules_of(obj: Any) -> list[nn.Module]:
    """``obj``'s modules when it is a module, else those of the modules among its attributes (a
    trainer's ``model`` and ``ref_model``, a wrapper's ``module``)."""
    if isinstance(obj, nn.Module):
        return list(obj.modules())
    return [m for value in vars(obj).values() if isinstance(value, nn.Module) for m in value.modules()]


def handles(obj: Any) -> list[Handle]:
    """The active handles of the patches that act on ``obj`` (a model, or anything whose attributes
    hold one) or on a module inside it: :func:`~model_patches.enable_linear_cross_entropy` and
    :func:`~model_patches.enable_chunked_loss` with ``model=``.

    A deep copy or an unpickled copy of a model under the hidden-state loss has a patch of its own;
    this returns its handle, and removing it leaves the original's in place (and the reverse). The
    chunked loss routes every model's loss and watches the model it was given, not its copies.
    Process-wide patches (:func:`~model_patches.enable_packing`, :func:`~model_patches.enable_trl_heads`,
    ``enable_chunked_loss()`` without a model) act on every model and are not listed here.
    """
    return [h for m in modules_of(obj) for h in tracked(m)]
