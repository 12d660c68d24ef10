"""Per-token log-probabilities, entropy and the extra statistics of the tempered softmax: the
chunk maths."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..spec import LossSpec
from .common import chain, counted, label_hit, scaled, target_logit, where_p

#: The statistic columns each extra statistic needs: ``(name, kind)`` (kinds as in
#: :mod:`functional_ce.maths`). ``log(sum p**2)`` is ``logsumexp(2 z) - 2 logsumexp(z)``; the
#: label is the first arg-max when its logit is >= every logit and > every logit before it.
_STAT_COLUMNS = {
    "log_sum_sq_probs": (("lse2", "lse"),),
    "mean_logits": (("sum", "sum"),),
    "is_top1": (("max", "max"), ("max_before", "max")),
}


def logp_columns(spec: LossSpec) -> tuple[tuple[str, str], ...]:
    """``(name, kind)`` of each statistic column: the logsumexp, the target logit, the mean logit
    under the softmax (with the entropy), then those of ``spec.stats`` in its order."""
    cols: tuple[tuple[str, str], ...] = (("lse", "lse"), ("target", "sum"))
    if spec.return_entropy:
        cols += (("mean", "mean@0"),)
    for name in spec.stats:
        cols += _STAT_COLUMNS[name]
    return cols


def logp_kinds(spec: LossSpec) -> tuple[tuple[str, ...]]:
    return (tuple(kind for _, kind in logp_columns(spec)),)


def logp_stats(zs: Sequence[torch.Tensor], labels: torch.Tensor, prior: Optional[torch.Tensor], spec: LossSpec
               ) -> torch.Tensor:
    """``[c, k]`` fp32 of the tempered logits ``x`` of this slice, columns as
    :func:`logp_columns` says: the slice's logsumexp, the target's ``x`` where it lies in the
    slice (else 0), the mean of ``x`` under the slice's own softmax (with the entropy; combined
    across slices weighted by each slice's mass), and per extra statistic: the logsumexp of
    ``2 x``, the sum of ``x``, or the slice's max of ``x`` and its max over the classes before
    the label."""
    x = scaled(zs[0], spec)
    lse = torch.logsumexp(x, dim=-1)
    parts = [lse, target_logit(x, labels, spec)[0]]
    if spec.return_entropy:
        # the mean of x - max, plus max: summing x itself loses the digits that lse - mean keeps
        top = torch.where(torch.isfinite(lse), x.amax(dim=-1), 0.0).unsqueeze(-1)
        parts.append(where_p(torch.exp(x - lse.unsqueeze(-1)), x - top).sum(dim=-1) + top.squeeze(-1))
    for name in spec.stats:
        if name == "log_sum_sq_probs":
            parts.append(torch.logsumexp(2.0 * x, dim=-1))
        elif name == "mean_logits":
            parts.append(x.sum(dim=-1))
        else:  # is_top1
            cols = torch.arange(x.shape[-1], device=x.device, dtype=torch.int32) + spec.vocab_start
            before = cols.unsqueeze(0) < labels.int().unsqueeze(-1)
            parts += [x.amax(dim=-1), torch.where(before, x, -torch.inf).amax(dim=-1)]
    return torch.stack(parts, dim=-1)


def logp_rows(stats: torch.Tensor, labels: torch.Tensor, spec: LossSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """``logp [c]``, or ``[c, m]``: logp, the entropy (with ``return_entropy``), then each of
    ``spec.stats`` (``is_top1`` as 1.0 / 0.0), from the full-vocabulary statistics, 0 on ignored
    rows; saved ``[c, 1]`` logsumexp (``[c, 2]`` with the entropy)."""
    col = {name: stats[:, i] for i, (name, _) in enumerate(logp_columns(spec))}
    lse, valid = col["lse"], counted(labels, spec)
    logp = torch.where(valid, col["target"] - lse, 0.0)
    if not spec.return_entropy and not spec.stats:
        return logp, lse.unsqueeze(-1)
    outs, saved = [logp], [lse]
    if spec.return_entropy:
        entropy = torch.where(valid, lse - col["mean"], 0.0)
        outs.append(entropy)
        saved.append(entropy)
    for name in spec.stats:
        if name == "log_sum_sq_probs":
            value = col["lse2"] - 2.0 * lse
        elif name == "mean_logits":
            value = col["sum"] / spec.n_classes
        else:  # is_top1
            value = ((col["target"] >= col["max"]) & (col["target"] > col["max_before"])).float()
        outs.append(torch.where(valid, value, 0.0))
    return torch.stack(outs, dim=-1), torch.stack(saved, dim=-1)


def logp_grad(zs: Sequence[torch.Tensor], labels: torch.Tensor, saved: torch.Tensor, grad_rows: torch.Tensor,
              spec: LossSpec) -> tuple[torch.Tensor]:
    """Gradient of ``sum(grad_rows * rows)`` w.r.t. the chunk ``z`` (its dtype): ``d logp / dz =
    onehot - p`` and ``d entropy / dz = -p (log p + entropy)``, chained through the temperature,
    softcap and logit scale; zero on ignored rows. The extra statistics have no gradient."""
    z = zs[0]
    x = scaled(z, spec)
    valid = counted(labels, spec)
    g = torch.where(valid.unsqueeze(-1), grad_rows.float().reshape(z.shape[0], -1), 0.0)
    logp = x - saved[:, :1]
    p = torch.exp(logp)
    grad = torch.where(label_hit(x, labels, spec), g[:, :1], 0.0) - p * g[:, :1]
    if spec.return_entropy:
        grad = grad - g[:, 1:2] * where_p(p, logp + saved[:, 1:2])
    grad = torch.where(valid.unsqueeze(-1), chain(grad, z, spec), 0.0)
    return (grad.to(z.dtype),)
