"""The loss's steps as custom operators, and :func:`loss_rows`, the entry every public loss calls.

Each step of :mod:`functional_ce.driver` (statistics, rows, the gradients by recompute, or the
fused forward that computes gradients as it goes) is one ``torch.library`` operator with a fake
kernel and, where it has one, an autograd formula (the backward functions below), so a user's
``torch.compile(fullgraph=True)`` sees one node per step. Operators take tensors plus the spec as
one string. Double backward through their closed-form gradients raises.

Call path: public function (:mod:`functional_ce.loss`, :mod:`functional_ce.token_losses`) ->
:func:`loss_rows` -> an operator -> its loop in :mod:`functional_ce.driver` -> the compiled chunk
graph (:mod:`functional_ce.compiled_chunks`, :mod:`functional_ce.chunk`) -> the loss's maths
(:mod:`functional_ce.maths`).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Optional, Sequence, Union

import torch
from torch._subclasses.fake_tensor import is_fake

from .driver import (
    fused_fake,
    fused_impl,
    linear_grads_fake,
    linear_grads_impl,
    logits_grad_into_impl,
    rows_fake,
    rows_impl,
    stats_fake,
    stats_impl,
)
from .inputs import Tokens, reduce_rows, row_coefficients
from .maths import LOSSES
from .spec import LossSpec, decode

__all__ = ["IMPLEMENTATIONS", "custom_operator", "refuse_double_backward", "loss_rows"]

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


# --- the driver's steps as operators ----------------------------------------------------------

_stats = custom_operator("stats", stats_impl, stats_fake)
_logits_grad_into = custom_operator("logits_grad_into", logits_grad_into_impl, lambda *args: None,
                              mutates=("out", "out2"))
_linear_grads = custom_operator("linear_grads", linear_grads_impl, linear_grads_fake)

_INPUTS = ("x", "weight", "bias", "x2", "weight2", "bias2")


def _rows_backward(saved: dict, spec: LossSpec, needs: dict, grad_rows: torch.Tensor) -> dict:
    x, weight, bias, x2, weight2, bias2, labels, kept = (saved[n] for n in (*_INPUTS, "labels", "out1"))
    inputs = (x, weight, bias, x2, weight2, bias2)
    if spec.form == "logits":
        want2 = x2 is not None and needs["x2"] and spec.teacher_grad
        if not (needs["x"] or want2):
            return {}
        with torch.no_grad():
            out = x if spec.inplace_grad else torch.empty_like(x, memory_format=torch.contiguous_format)
            out2 = torch.empty_like(x2, memory_format=torch.contiguous_format) if want2 else None
            if x.shape[1] > 0:  # an empty vocabulary slice has nothing to write
                _logits_grad_into(grad_rows.float(), x, x2, labels, kept, out, out2, spec.encode())
            elif out2 is not None:
                out2.zero_()
        grads = refuse_double_backward((out if needs["x"] else None, out2), (x, x2), spec)
        return dict(zip(("x", "x2"), grads))
    want = [t is not None and needs[n] for n, t in zip(_INPUTS, inputs)]
    want[3:] = [w and spec.teacher_grad for w in want[3:]]
    if not any(want):
        return {}
    with torch.no_grad():
        if weight.shape[0] == 0:  # an empty vocabulary slice: no logits, no gradient
            grads = tuple(None if t is None else torch.zeros_like(t) for t in inputs)
        else:
            grads = _linear_grads(grad_rows.float(), *inputs, labels, kept, want, spec.encode())
    grads = tuple(g if w else None for g, w in zip(grads, want))
    return dict(zip(_INPUTS, refuse_double_backward(grads, inputs, spec)))


_rows = custom_operator("rows", rows_impl, rows_fake, backward=_rows_backward, save=(*_INPUTS, "labels", "out1"))


_HEAD = ("hidden", "weight", "bias", "hidden2", "weight2", "bias2")


def _unit_scale(grad_loss: torch.Tensor) -> bool:
    """Whether the loss's incoming gradient is exactly 1 and reading it costs nothing: a CPU scalar
    outside tracing and functorch transforms (on an accelerator the read would wait for the device)."""
    if grad_loss.device.type != "cpu" or grad_loss.numel() != 1 or torch.compiler.is_compiling():
        return False
    if torch._C._are_functorch_transforms_active() or is_fake(grad_loss):
        return False
    return bool(grad_loss == 1)


def _fused_backward(saved: dict, spec: LossSpec, needs: dict, grad_loss: torch.Tensor) -> dict:
    computed = saved["needs"]
    # ``loss.backward()`` sends 1: the gradients computed in forward are handed on as they are,
    # not copied (a second [V, H] buffer for the weight's, while the saved one is alive). Autograd
    # frees what it saved before the gradient reaches AccumulateGrad, which then takes the buffer
    # as the parameter's .grad; with retain_graph=True it copies it instead, as for any gradient.
    scale = None if _unit_scale(grad_loss) else grad_loss.float()
    mul = (lambda t: t) if scale is None else (lambda t: t * scale)  # a 0-dim scale keeps each dtype
    with torch.no_grad():
        scaled = tuple(
            mul(saved[f"out{i + 2}"]) if computed[i] and needs[name] else None
            for i, name in enumerate(_HEAD)
        )
        grad_coef = mul(saved["out1"]) if needs["coef"] else None
    grads = refuse_double_backward(scaled, tuple(saved[n] for n in _HEAD), spec)
    return dict(zip(_HEAD, grads), coef=grad_coef)


def _fused_saves(named: dict) -> tuple[str, ...]:
    """The loss rows and the computed gradients (the second input's only when it gets them: its
    outputs are empty placeholders otherwise), the inputs and the flags."""
    second = named["hidden2"] is not None and decode(named["spec"]).teacher_grad
    return ("out1", "out2", "out3", "out4", *(("out5", "out6", "out7") if second else ()), *_HEAD, "needs")


_fused = custom_operator("fused", fused_impl, fused_fake, backward=_fused_backward, save=_fused_saves)


# --- the entry point ---------------------------------------------------------------------------


def loss_rows(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], tokens: Tokens,
              spec: LossSpec, combine: Optional[Callable[[torch.Tensor, Sequence[str]], torch.Tensor]] = None,
              second: Optional[tuple] = None) -> torch.Tensor:
    """The loss of ``x`` ``[N, C]`` (logits, or hidden states with ``weight``/``bias``) reduced as
    ``spec`` says: fp32, a scalar, ``tokens.batch_shape``, or ``[*batch_shape, m]`` for a loss
    with ``m`` outputs per row.

    ``second`` is the second input ``(x2, weight2, bias2)`` of a loss that reads two (the teacher
    of a distillation loss; its gradient is computed when ``spec.teacher_grad``).
    ``combine(stats [N, k], kinds)`` turns one vocabulary slice's statistics into the full
    vocabulary's (vocabulary parallelism); None on one process.
    """
    x2, weight2, bias2 = (None, None, None) if second is None else second
    encoded = spec.encode()
    if spec.form == "linear":
        needs = [t is not None and t.requires_grad for t in (x, weight, bias, x2, weight2, bias2)]
        needs[3:] = [n and spec.teacher_grad for n in needs[3:]]
        fused = spec.reduction != "none" and not spec.recompute_logits_in_backward and combine is None
        if fused and torch.is_grad_enabled() and any(needs):
            coef = row_coefficients(tokens, spec)
            return _fused(x, weight, bias, x2, weight2, bias2, tokens.labels, coef, needs, encoded)[0]
    inputs = (x, weight, bias, x2, weight2, bias2)
    detached = [None if t is None else t.detach() for t in inputs]
    maths = LOSSES[spec.loss]
    if combine is None:
        stats = _stats(*detached, tokens.labels, None, encoded)
    else:  # pass by pass, each combined across the vocabulary's shards before the next
        stats = None
        for i, kinds in enumerate(maths.kinds(spec)):
            part = _stats(*detached, tokens.labels, stats, dataclasses.replace(spec, stats_pass=i).encode())
            part = combine(part, kinds)
            stats = part if stats is None else torch.cat([stats, part], dim=-1)
    rows, _ = _rows(*inputs, tokens.labels, stats, encoded)
    return reduce_rows(rows, tokens, spec)
