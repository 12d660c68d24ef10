"""Per-token log-probabilities and entropy of the tempered softmax: the chunk maths."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..spec import LossSpec
from .common import chain, label_hit, scaled, target_logit, counted, where_p


def logp_stats(zs: Sequence[torch.Tensor], labels: torch.Tensor, prior: Optional[torch.Tensor], spec: LossSpec
               ) -> torch.Tensor:
    """``[c, 2]`` (``[c, 3]`` with entropy) fp32 of the tempered logits ``z``: the slice's
    logsumexp, the target's ``z`` where it lies in the slice (else 0), and the mean of ``z`` under
    the slice's own softmax (combined across slices weighted by each slice's mass)."""
    x = scaled(zs[0], spec)
    lse = torch.logsumexp(x, dim=-1)
    parts = [lse, target_logit(x, labels, spec)[0]]
    if spec.return_entropy:
        parts.append(where_p(torch.exp(x - lse.unsqueeze(-1)), x).sum(dim=-1))
    return torch.stack(parts, dim=-1)


def logp_rows(stats: torch.Tensor, labels: torch.Tensor, spec: LossSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """``logp [c]`` (``[c, 2]``: logp, entropy) from the full-vocabulary statistics, 0 on ignored
    rows; saved ``[c, 1]`` logsumexp (``[c, 2]`` with the entropy)."""
    lse, valid = stats[:, 0], counted(labels, spec)
    logp = torch.where(valid, stats[:, 1] - lse, 0.0)
    if not spec.return_entropy:
        return logp, lse.unsqueeze(-1)
    entropy = torch.where(valid, lse - stats[:, 2], 0.0)
    return torch.stack([logp, entropy], dim=-1), torch.stack([lse, entropy], dim=-1)


def logp_grad(zs: Sequence[torch.Tensor], labels: torch.Tensor, saved: torch.Tensor, grad_rows: torch.Tensor,
              spec: LossSpec) -> tuple[torch.Tensor]:
    """Gradient of ``sum(grad_rows * rows)`` w.r.t. the chunk ``z`` (its dtype): ``d logp / dz =
    onehot - p`` and ``d entropy / dz = -p (log p + entropy)``, chained through the temperature
    and softcap; zero on ignored rows."""
    z = zs[0]
    x = scaled(z, spec)
    valid = counted(labels, spec)
    g = torch.where(valid.unsqueeze(-1), grad_rows.float().reshape(z.shape[0], -1), 0.0)
    logp = x - saved[:, :1]
    p = torch.exp(logp)
    grad = torch.where(label_hit(x, labels, spec), g[:, :1], 0.0) - p * g[:, :1]
    if spec.return_entropy:
        grad = grad - g[:, 1:] * where_p(p, logp + saved[:, 1:])
    grad = torch.where(valid.unsqueeze(-1), chain(grad, z, spec), 0.0)
    return (grad.to(z.dtype),)
