"""Distillation's chunk maths: TRL GKD's generalized Jensen-Shannon divergence between a student's
and a teacher's tempered softmax, in two passes of statistics (the logsumexps, then the sums)."""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from ..spec import LossSpec
from .common import chain, counted, scaled, where_p


def kd_lse(zs: Sequence[torch.Tensor], labels: torch.Tensor, prior: Optional[torch.Tensor], spec: LossSpec
           ) -> torch.Tensor:
    """Pass 1, ``[c, 2]`` fp32: the slice's logsumexp of the student's and of the teacher's
    tempered logits (each scaled and soft-capped with its own model's values)."""
    return torch.stack([torch.logsumexp(scaled(z, spec, teacher=i == 1), dim=-1) for i, z in enumerate(zs)], dim=-1)


def _kd_logps(zs: Sequence[torch.Tensor], lse: torch.Tensor, spec: LossSpec) -> tuple[torch.Tensor, ...]:
    """``(log p_s, log p_t, log m or None)`` ``[c, V_slice]`` fp32 from the full-vocabulary
    logsumexps ``lse [c, 2]``; ``m = beta * p_t + (1 - beta) * p_s`` (only for 0 < beta < 1)."""
    ls = scaled(zs[0], spec) - lse[:, :1]
    lt = scaled(zs[1], spec, teacher=True) - lse[:, 1:2]
    if spec.beta in (0.0, 1.0):
        return ls, lt, None
    return ls, lt, torch.logaddexp(ls + math.log(1.0 - spec.beta), lt + math.log(spec.beta))


def kd_divergence(zs: Sequence[torch.Tensor], labels: torch.Tensor, prior: Optional[torch.Tensor],
                  spec: LossSpec) -> torch.Tensor:
    """Pass 2, fp32 sums over the slice given the full logsumexps ``prior [c, 2]``: ``[c, 1]``
    ``KL(t || s)`` (beta 0) or ``KL(s || t)`` (beta 1), else ``[c, 2]`` ``KL(t || m), KL(s || m)``."""
    ls, lt, lm = _kd_logps(zs, prior, spec)
    ps, pt = torch.exp(ls), torch.exp(lt)
    if spec.beta == 0.0:
        parts = [where_p(pt, lt - ls)]
    elif spec.beta == 1.0:
        parts = [where_p(ps, ls - lt)]
    else:
        parts = [where_p(pt, lt - lm), where_p(ps, ls - lm)]
    return torch.stack([t.sum(dim=-1) for t in parts], dim=-1)


def kd_rows(stats: torch.Tensor, labels: torch.Tensor, spec: LossSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row divergence ``[c]`` (0 on ignored rows) and the statistics its gradient needs
    (both logsumexps and the divergences, ``[c, 3]`` or ``[c, 4]``)."""
    beta = spec.beta
    loss = stats[:, 2] if beta in (0.0, 1.0) else beta * stats[:, 2] + (1.0 - beta) * stats[:, 3]
    return torch.where(counted(labels, spec), loss, 0.0), stats


def kd_grad(zs: Sequence[torch.Tensor], labels: torch.Tensor, saved: torch.Tensor, grad_rows: torch.Tensor,
            spec: LossSpec) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Gradients of ``sum(grad_rows * divergence)`` w.r.t. the student's and (``spec.teacher_grad``)
    the teacher's chunk (their dtypes): for ``L = KL(a || b)`` over softmaxes of ``za``, ``zb``,
    ``dL/dza = p_a (log p_a - log p_b - L)`` and ``dL/dzb = p_b - p_a``; for the mixture,
    ``dL/dzs = (1 - beta) p_s (log p_s - log m - KL(s || m))`` and the same for the teacher with
    ``beta``; each chained through its own model's soft-cap and scale."""
    beta = spec.beta
    ls, lt, lm = _kd_logps(zs, saved, spec)
    ps, pt = torch.exp(ls), torch.exp(lt)
    kl = saved[:, 2:]
    if beta == 0.0:
        gs, gt = ps - pt, where_p(pt, lt - ls - kl)
    elif beta == 1.0:
        gs, gt = where_p(ps, ls - lt - kl), pt - ps
    else:
        gs = (1.0 - beta) * where_p(ps, ls - lm - kl[:, 1:])
        gt = beta * where_p(pt, lt - lm - kl[:, :1])
    valid = counted(labels, spec).unsqueeze(-1)
    g = torch.where(valid, grad_rows.float().unsqueeze(-1), 0.0)
    out = [torch.where(valid, chain(d * g, z, spec, teacher=i == 1), 0.0).to(z.dtype)
           for i, (d, z) in enumerate(zip((gs, gt), zs))]
    return out[0], out[1] if spec.teacher_grad else None
