"""fp64 references of the documented loss semantics, written independently of the library."""

from __future__ import annotations

from typing import Optional

import torch


def reference_cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    mask: Optional[torch.Tensor] = None,
    weights: Optional[torch.Tensor] = None,
    reduction: str = "mean",
    num_label_tokens=None,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: Optional[float] = None,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """The documented semantics computed straight from the definition, in ``dtype``.

    Differentiable with plain autograd; ``logits`` may be any float tensor ``[..., V]``.
    """
    v = logits.shape[-1]
    x = logits.reshape(-1, v).to(dtype)
    y = labels.reshape(-1).long()
    valid = y != ignore_index
    if mask is not None:
        valid = valid & mask.reshape(-1).bool()
    if softcap is not None:
        x = softcap * torch.tanh(x / softcap)
    logp = torch.log_softmax(x, dim=-1)
    nll = -logp.gather(1, torch.where(valid, y, 0).unsqueeze(1)).squeeze(1)
    per_token = nll
    if label_smoothing:
        per_token = (1 - label_smoothing) * nll + label_smoothing * (-logp.mean(dim=-1))
    if z_loss:
        per_token = per_token + z_loss * torch.logsumexp(x, dim=-1) ** 2
    per_token = torch.where(valid, per_token, torch.zeros((), dtype=dtype))
    if weights is not None:
        per_token = per_token * weights.reshape(-1).to(dtype)
    if reduction == "none":
        return per_token.reshape(labels.shape)
    total = per_token.sum()
    if num_label_tokens is not None:
        n = float(num_label_tokens)
        return total / n if n > 0 else total * 0
    if reduction == "mean":
        return total / max(int(valid.sum()), 1)
    return total
