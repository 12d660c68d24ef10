"""References the tests compare the library with: fp64 losses of the documented semantics,
written independently of the library, and a Hugging Face model's own loss."""

from __future__ import annotations

import math
from typing import Optional

import torch

from tests.support.batches import grads


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


def tempered(logits: torch.Tensor, *, temperature: float = 1.0, softcap: Optional[float] = None,
             logit_scale: float = 1.0, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The logits a token loss sees, in ``dtype``: ``x = logits * logit_scale``, then
    ``softcap * tanh(x / softcap)`` (if given), then ``/ temperature``."""
    x = logits.to(dtype) * logit_scale
    if softcap is not None:
        x = softcap * torch.tanh(x / softcap)
    return x / temperature


def reference_token_logprobs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    softcap: Optional[float] = None,
    ignore_index: int = -100,
    dtype: torch.dtype = torch.float64,
    logit_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logp, entropy)`` ``[...]`` in ``dtype`` from the definition: ``x * logit_scale``, then
    ``z = softcap * tanh(x / softcap)`` (if given), then ``z / temperature``; ``logp =
    log_softmax(z)[label]``, ``entropy = -(softmax(z) * log_softmax(z)).sum(-1)``; both 0 where the
    label is ``ignore_index``."""
    z = tempered(logits, temperature=temperature, softcap=softcap, logit_scale=logit_scale, dtype=dtype)
    logp_all = torch.log_softmax(z, dim=-1)
    valid = labels != ignore_index
    logp = logp_all.gather(-1, torch.where(valid, labels, 0).long().unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    zero = torch.zeros((), dtype=dtype, device=z.device)
    return torch.where(valid, logp, zero), torch.where(valid, entropy, zero)


def reference_token_stats(
    logits: torch.Tensor,
    labels: torch.Tensor,
    names: tuple[str, ...],
    *,
    temperature: float = 1.0,
    softcap: Optional[float] = None,
    logit_scale: float = 1.0,
    ignore_index: int = -100,
    dtype: torch.dtype = torch.float64,
) -> list[torch.Tensor]:
    """The extra statistics ``names`` of :func:`functional_ce.token_logprobs` from the definition,
    detached, on the tempered logits ``z`` of :func:`reference_token_logprobs`: ``is_top1`` (bool:
    ``argmax(z) == label``, torch's argmax being the first maximum), ``log_sum_sq_probs``
    (``log(sum softmax(z) ** 2)``) and ``mean_logits`` (``z.mean(-1)``); 0 / False where ignored."""
    z = tempered(logits.detach(), temperature=temperature, softcap=softcap, logit_scale=logit_scale, dtype=dtype)
    valid = labels != ignore_index
    zero = torch.zeros((), dtype=dtype, device=z.device)
    value = {
        "is_top1": valid & (z.argmax(-1) == labels),
        "log_sum_sq_probs": torch.where(valid, torch.log((torch.softmax(z, -1) ** 2).sum(-1)), zero),
        "mean_logits": torch.where(valid, z.mean(-1), zero),
    }
    return [value[n] for n in names]


def reference_generalized_jsd(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    counted: torch.Tensor,
    *,
    beta: float = 0.5,
    temperature: float = 1.0,
    reduction: str = "mean",
    num_label_tokens=None,
    dtype: torch.dtype = torch.float64,
    softcap: Optional[float] = None,
    teacher_softcap: Optional[float] = None,
    logit_scale: float = 1.0,
    teacher_logit_scale: float = 1.0,
) -> torch.Tensor:
    """TRL GKD's ``generalized_jsd_loss`` per token ``[...]`` (summed over the vocabulary) on the
    ``counted`` (bool ``[...]``) positions, reduced like :func:`reference_cross_entropy`; each
    model's logits go through :func:`tempered` with its own scale and soft-cap."""
    s = torch.log_softmax(tempered(student_logits, temperature=temperature, softcap=softcap,
                                   logit_scale=logit_scale, dtype=dtype), dim=-1)
    t = torch.log_softmax(tempered(teacher_logits, temperature=temperature, softcap=teacher_softcap,
                                   logit_scale=teacher_logit_scale, dtype=dtype), dim=-1)

    def kl(p_log: torch.Tensor, q_log: torch.Tensor) -> torch.Tensor:  # KL(p || q)
        return (p_log.exp() * (p_log - q_log)).sum(-1)

    if beta == 0:
        per_token = kl(t, s)
    elif beta == 1:
        per_token = kl(s, t)
    else:
        m = torch.logsumexp(torch.stack([s + math.log(1 - beta), t + math.log(beta)]), dim=0)
        per_token = beta * kl(t, m) + (1 - beta) * kl(s, m)
    per_token = torch.where(counted, per_token, torch.zeros((), dtype=dtype, device=per_token.device))
    if reduction == "none":
        return per_token
    total = per_token.sum()
    if num_label_tokens is not None:
        n = float(num_label_tokens)
        return total / n if n > 0 else total * 0
    return total / max(int(counted.sum()), 1) if reduction == "mean" else total


def model_loss_and_grads(model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The model's own ``model(**batch).loss`` (full logits) and the gradients its backward leaves
    on every parameter; the model's gradients are cleared afterwards."""
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), grads(model)
