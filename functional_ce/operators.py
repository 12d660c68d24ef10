"""The driver's custom operators: how each step of :mod:`functional_ce.driver` becomes one
``torch.library`` operator with a fake kernel and, where it has one, an autograd formula; and the
guard that makes double backward through their closed-form gradients raise."""

from __future__ import annotations

import inspect
from typing import Any, Callable, Optional, Sequence, Union

import torch

from .maths import LOSSES
from .spec import LossSpec, decode

__all__ = ["IMPLEMENTATIONS", "custom_operator", "refuse_double_backward"]

#: Operator name -> its Python implementation (lets tests trace allocations inside the loops).
IMPLEMENTATIONS: dict[str, Callable] = {}

Backward = Callable[..., dict[str, Optional[torch.Tensor]]]


def custom_operator(name: str, impl: Callable, fake: Callable, *, mutates: Sequence[str] = (),
              backward: Optional[Backward] = None,
              save: Union[Sequence[str], Callable[[dict], Sequence[str]]] = ()) -> Any:
    """Register ``impl`` as the custom operator ``functional_ce::name`` with its fake kernel.

    With ``backward``, autograd is registered too: ``save`` names the inputs (``impl``'s parameter
    names) and outputs (``"out0"``, ``"out1"``...) kept for backward (tensors through
    ``save_for_backward``, anything else as it is; or a function of the call's named inputs and
    outputs that returns those names), which is called as
    ``backward(saved: dict, spec, needs: dict, grad_out0)`` and returns gradients by input name;
    inputs it leaves out get None. Only the first output is differentiable.
    """
    op = torch.library.custom_op(f"functional_ce::{name}", impl, mutates_args=tuple(mutates))
    op.register_fake(fake)
    IMPLEMENTATIONS[f"functional_ce::{name}"] = impl
    if backward is None:
        return op
    params = list(inspect.signature(impl).parameters)

    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        outputs = output if isinstance(output, tuple) else (output,)
        named = dict(zip(params, inputs), **{f"out{i}": o for i, o in enumerate(outputs)})
        ctx.mark_non_differentiable(*outputs[1:])
        ctx.set_materialize_grads(False)  # no zero-filled gradients of the other outputs
        ctx.spec = decode(named["spec"])
        names = save(named) if callable(save) else save
        ctx.tensor_names = [n for n in names if named[n] is None or isinstance(named[n], torch.Tensor)]
        ctx.constants = {n: named[n] for n in names if n not in ctx.tensor_names}
        ctx.save_for_backward(*(named[n] for n in ctx.tensor_names))

    def autograd_backward(ctx: Any, grad: Optional[torch.Tensor], *unused: Any) -> tuple:
        if grad is None:
            return (None,) * len(params)
        saved = dict(zip(ctx.tensor_names, ctx.saved_tensors), **ctx.constants)
        grads = backward(saved, ctx.spec, dict(zip(params, ctx.needs_input_grad)), grad)
        return tuple(grads.get(p) for p in params)

    op.register_autograd(autograd_backward, setup_context=setup_context)
    return op


class _RefuseDoubleBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, what: str, n_grads: int, *tensors: torch.Tensor) -> tuple:
        ctx.what = what
        return tuple(t.view_as(t) for t in tensors[:n_grads])

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple:
        name, instead = ctx.what
        raise RuntimeError(
            f"functional_ce {name} does not support double backward (create_graph=True followed by "
            f"another backward through its gradients); use {instead} for that"
        )


def refuse_double_backward(grads: tuple, inputs: tuple, spec: LossSpec) -> tuple:
    """``grads`` unchanged, or, under ``create_graph=True``, views of them whose backward raises
    (the gradients are closed-form, with no graph of their own to differentiate)."""
    if not torch.is_grad_enabled() or torch.compiler.is_compiling():
        return grads
    present = [g for g in grads if g is not None]
    anchors = [t for t in inputs if t is not None]
    if not present or not any(t.requires_grad for t in anchors):
        return grads
    what = LOSSES[spec.loss].names[0 if spec.form == "logits" else 1]
    guarded = iter(_RefuseDoubleBackward.apply(what, len(present), *present, *anchors))
    return tuple(None if g is None else next(guarded) for g in grads)
