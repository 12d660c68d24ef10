"""The graphs that torch.compile sees per chunk, and how they run.

Each loss's pure chunk maths is a :class:`~functional_ce.maths.LossMaths` entry of
:data:`~functional_ce.maths.LOSSES` (its statistics pass by pass, its rows and its gradient;
``spec`` is the call's :class:`~functional_ce.spec.LossSpec`). :func:`chunk_forward` and
:func:`chunk_backward` are cross-entropy's, as pure per-chunk functions.

The ``*_chunk`` / ``*_into`` functions below are the graphs the driver runs per chunk: they build
a chunk's logits (``hidden @ weight.T + bias`` for the hidden-state form) and call the loss's
functions. :func:`functional_ce.compiled_chunks.run_chunk` runs each through a compiled graph of its own
configuration.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from .maths import LOSSES
from .spec import LossSpec


def chunk_forward(logits_chunk: torch.Tensor, labels_chunk: torch.Tensor, *, opts: LossSpec
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy's per-row loss and logsumexp of one chunk ``[c, V]`` (all classes): fp32
    ``[c]`` each, the loss 0 on ignored rows."""
    opts = _full_vocabulary(opts, logits_chunk)
    maths = LOSSES[opts.loss]
    loss, saved = maths.rows(maths.stats((logits_chunk,), labels_chunk, None, opts), labels_chunk, opts)
    return loss, saved[:, 0]


def chunk_backward(logits_chunk: torch.Tensor, labels_chunk: torch.Tensor, lse: torch.Tensor,
                   grad_rows: torch.Tensor, *, opts: LossSpec) -> torch.Tensor:
    """Gradient of ``sum(grad_rows * loss_rows)`` w.r.t. one chunk of logits ``[c, V]``, given the
    ``lse`` ``[c]`` of :func:`chunk_forward`; in ``logits_chunk.dtype``, zero on ignored rows."""
    opts = _full_vocabulary(opts, logits_chunk)
    return LOSSES[opts.loss].grad((logits_chunk,), labels_chunk, lse.unsqueeze(-1), grad_rows, opts)[0]


def _full_vocabulary(opts: LossSpec, logits_chunk: torch.Tensor) -> LossSpec:
    """``opts`` for a chunk holding every class (``n_classes`` from the chunk when not given)."""
    return opts if opts.n_classes is not None else dataclasses.replace(opts, n_classes=logits_chunk.shape[-1])


# --- the graphs the driver runs per chunk ------------------------------------------------------
# A loss reads one input (logits, or hidden states with a head's weight and bias) or two
# (distillation: the student's and the teacher's, ``x2``/``weight2``/``bias2``; None otherwise).


def _logits(x: Optional[torch.Tensor], weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
            spec: LossSpec) -> Optional[torch.Tensor]:
    return x if spec.form == "logits" or x is None else F.linear(x, weight, bias)


def _inputs(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], x2: Optional[torch.Tensor],
            weight2: Optional[torch.Tensor], bias2: Optional[torch.Tensor], spec: LossSpec) -> tuple[torch.Tensor, ...]:
    """The chunk's logits of each input: ``(z,)`` or ``(z_student, z_teacher)``."""
    zs = (_logits(x, weight, bias, spec), _logits(x2, weight2, bias2, spec))
    return zs[:1] if x2 is None else zs


def forward_into(out: torch.Tensor, x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                 x2: Optional[torch.Tensor], weight2: Optional[torch.Tensor], bias2: Optional[torch.Tensor],
                 labels: torch.Tensor, prior: Optional[torch.Tensor], *, opts: LossSpec) -> None:
    """The statistics ``[c, k]`` of one chunk of rows (logits, or hidden states), into ``out``."""
    out.copy_(LOSSES[opts.loss].stats(_inputs(x, weight, bias, x2, weight2, bias2, opts), labels, prior, opts))


def backward_into(out: torch.Tensor, out2: Optional[torch.Tensor], logits: torch.Tensor,
                  logits2: Optional[torch.Tensor], labels: torch.Tensor, saved: torch.Tensor, grad_rows: torch.Tensor,
                  *, opts: LossSpec) -> None:
    """The logits' gradient ``[c, V]`` of one chunk, into ``out`` (which may be ``logits`` itself),
    and the second input's into ``out2`` when given."""
    zs = (logits,) if logits2 is None else (logits, logits2)
    grads = LOSSES[opts.loss].grad(zs, labels, saved, grad_rows, opts)
    out.copy_(grads[0])
    if out2 is not None:
        out2.copy_(grads[1])


def _head_grads(grads: Sequence[Optional[torch.Tensor]], weights: Sequence[Optional[torch.Tensor]]) -> tuple:
    """``(grad_hidden [c, H], grad_logits [c, V])`` per input (None for one without a gradient)."""
    out: tuple = ()
    for g, w in zip(grads, weights):
        out += (None, None) if g is None else (g @ w, g)
    return out


def linear_backward_chunk(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                          hidden2: Optional[torch.Tensor], weight2: Optional[torch.Tensor],
                          bias2: Optional[torch.Tensor], labels: torch.Tensor, saved: torch.Tensor,
                          grad_rows: torch.Tensor, *, opts: LossSpec) -> tuple:
    """Recompute one chunk's logits; return ``(grad_hidden [c, H], grad_logits [c, V])`` in the
    input dtype, then the second input's (None, None when it has no gradient); the driver folds
    ``grad_logits`` into the weight and bias gradients."""
    zs = _inputs(hidden, weight, bias, hidden2, weight2, bias2, opts)
    return _head_grads(LOSSES[opts.loss].grad(zs, labels, saved, grad_rows, opts), (weight, weight2))


def linear_fused_chunk(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                       hidden2: Optional[torch.Tensor], weight2: Optional[torch.Tensor], bias2: Optional[torch.Tensor],
                       labels: torch.Tensor, coef: torch.Tensor, *, opts: LossSpec) -> tuple:
    """One chunk of the whole vocabulary with its gradients in forward: ``(loss fp32 [c],
    grad_hidden [c, H], grad_logits [c, V], ...the second input's)`` of ``sum(coef * loss)``, the
    logits built once."""
    maths = LOSSES[opts.loss]
    zs = _inputs(hidden, weight, bias, hidden2, weight2, bias2, opts)
    loss, saved = maths.rows(maths.stats(zs, labels, None, opts), labels, opts)
    return (loss, *_head_grads(maths.grad(zs, labels, saved, coef, opts), (weight, weight2)))


def accumulate_into(acc: torch.Tensor, partial: torch.Tensor, *, opts: LossSpec) -> None:
    """``acc [r, H] fp32 += partial [r, H]`` (low precision) in one pass (``opts`` unused)."""
    acc.add_(partial.to(acc.dtype))


def copy_into(out: torch.Tensor, src: torch.Tensor, *, opts: LossSpec) -> None:
    """``out [r, H] = src`` converted to ``out``'s dtype in one pass (``opts`` unused)."""
    out.copy_(src)


# --- compiled graphs, one per configuration ----------------------------------------------------

#: Configuration key -> ``(compiled callable, its own copy of the chunk function)``, or None
#: once compiling that configuration failed.
