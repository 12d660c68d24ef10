"""Cross-entropy's chunk maths: ``torch.nn.functional.cross_entropy``'s definition, with label
smoothing, z-loss and softcap."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..spec import LossSpec
from .common import chain, counted, label_hit, scaled, target_logit


def ce_stats(zs: Sequence[torch.Tensor], labels: torch.Tensor, prior: Optional[torch.Tensor], spec: LossSpec
             ) -> torch.Tensor:
    """``[c, 2]`` (``[c, 3]`` with label smoothing) fp32: the slice's logsumexp of the (soft-capped)
    logits, the target's logit where the target lies in the slice (else 0), and the sum of the
    slice's logits (what label smoothing needs)."""
    x = scaled(zs[0], spec)
    parts = [torch.logsumexp(x, dim=-1), target_logit(x, labels, spec)[0]]
    if spec.label_smoothing > 0.0:
        parts.append(x.sum(dim=-1))
    return torch.stack(parts, dim=-1)


def ce_rows(stats: torch.Tensor, labels: torch.Tensor, spec: LossSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row loss ``[c]`` from the full-vocabulary statistics (0 on ignored rows), and the
    logsumexp ``[c, 1]`` its gradient needs."""
    lse, target = stats[:, 0], stats[:, 1]
    loss = lse - target
    if spec.label_smoothing > 0.0:
        eps = spec.label_smoothing
        loss = (1.0 - eps) * loss + eps * (lse - stats[:, 2] / spec.n_classes)
    if spec.z_loss > 0.0:
        loss = loss + spec.z_loss * lse * lse
    return torch.where(counted(labels, spec), loss, 0.0), lse.unsqueeze(-1)


def ce_grad(zs: Sequence[torch.Tensor], labels: torch.Tensor, saved: torch.Tensor, grad_rows: torch.Tensor,
            spec: LossSpec) -> tuple[torch.Tensor]:
    """Gradient of ``sum(grad_rows * loss)`` w.r.t. the chunk ``z`` ``[c, V_slice]`` (its dtype),
    recomputing the softmax from the saved full-vocabulary logsumexp; zero on ignored rows."""
    z = zs[0]
    x = scaled(z, spec)
    lse = saved[:, 0]
    valid = counted(labels, spec)
    g = torch.where(valid, grad_rows.float(), 0.0)
    eps = spec.label_smoothing
    p_scale = g * (1.0 + 2.0 * spec.z_loss * lse) if spec.z_loss > 0.0 else g
    probs = torch.exp(x - lse.unsqueeze(-1))
    grad = probs * p_scale.unsqueeze(-1) - torch.where(label_hit(x, labels, spec), (g * (1.0 - eps)).unsqueeze(-1), 0.0)
    if eps > 0.0:
        grad = grad - (g * (eps / spec.n_classes)).unsqueeze(-1)
    grad = torch.where(valid.unsqueeze(-1), chain(grad, z, spec), 0.0)
    return (grad.to(z.dtype),)
