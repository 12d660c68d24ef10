"""Gradients that refuse to be differentiated again.

The losses compute closed-form gradients with no autograd graph of their own, so a second
backward through them (``create_graph=True`` followed by a backward of the gradient) has no
correct answer to give. When a backward formula runs with gradient mode on (that is what
``create_graph=True`` does), :func:`refuse_double_backward` ties its results to the inputs through
a node whose backward raises, whichever buffer holds the gradient (a new tensor or, with
``inplace_grad``, the logits themselves).
"""

from __future__ import annotations

from typing import Any, Optional

import torch


class _RefuseDoubleBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, what: str, instead: str, n_grads: int, *tensors: torch.Tensor) -> tuple:
        ctx.what, ctx.instead = what, instead
        return tuple(t.view_as(t) for t in tensors[:n_grads])

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple:
        raise RuntimeError(
            f"functional_ce {ctx.what} does not support double backward (create_graph=True followed by "
            f"another backward through its gradients); use {ctx.instead} for that"
        )


def refuse_double_backward(
    grads: tuple[Optional[torch.Tensor], ...], inputs: tuple[Optional[torch.Tensor], ...], what: str, instead: str
) -> tuple[Optional[torch.Tensor], ...]:
    """``grads`` unchanged, or, under ``create_graph=True``, views of them whose backward raises.

    ``inputs`` are the tensors the gradients belong to (they connect the new node to the graph);
    ``what`` names the loss and ``instead`` the function to use for higher-order gradients.
    """
    if not torch.is_grad_enabled() or torch.compiler.is_compiling():
        return grads
    present = [g for g in grads if g is not None]
    anchors = [t for t in inputs if t is not None]
    if not present or not any(t.requires_grad for t in anchors):
        return grads
    guarded = iter(_RefuseDoubleBackward.apply(what, instead, len(present), *present, *anchors))
    return tuple(None if g is None else next(guarded) for g in grads)
