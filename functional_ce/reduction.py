"""The reduction of per-row losses: weights, then ``"mean"`` / ``"sum"`` / ``"none"`` with
``num_label_tokens``, as :func:`functional_ce.cross_entropy` documents it; and each row's factor
in the scalar loss, for losses whose gradients are computed in forward."""

from __future__ import annotations

from typing import Union

import torch

from .inputs import Tokens
from .spec import LossSpec

__all__ = ["reduce_rows", "row_coefficients"]


def _denominator(tokens: Tokens, spec: LossSpec) -> Union[float, torch.Tensor, None]:
    """What the weighted sum is divided by: None for a plain sum."""
    if tokens.num_label_tokens is not None:
        return tokens.num_label_tokens
    if spec.reduction == "mean":
        return (tokens.labels != spec.ignore_index).sum()
    return None


def _divide(x: torch.Tensor, count: Union[float, torch.Tensor, None]) -> torch.Tensor:
    """``x / count``, 0 where the count is 0."""
    if count is None:
        return x
    if isinstance(count, torch.Tensor):
        n = count.reshape(()).to(device=x.device, dtype=torch.float32)
        return torch.where(n > 0, x / torch.where(n > 0, n, 1.0), 0.0)
    return x / float(count) if count > 0 else x * 0.0


def row_coefficients(tokens: Tokens, spec: LossSpec) -> torch.Tensor:
    """``[N]`` fp32: each row's factor in the scalar loss (weight over denominator, 0 if ignored),
    so that the reduction equals ``sum(coef * loss_rows)``."""
    valid = (tokens.labels != spec.ignore_index).float()
    if tokens.weights is not None:
        valid = valid * tokens.weights.reshape(-1).float()
    return _divide(valid, _denominator(tokens, spec))


def reduce_rows(loss_rows: torch.Tensor, tokens: Tokens, spec: LossSpec) -> torch.Tensor:
    """Weights, then the reduction, of fp32 per-row losses ``[N]`` (0 on ignored rows): ``"mean"``
    divides the weighted sum by ``num_label_tokens`` when given, else by the number of valid
    tokens; ``"sum"`` by ``num_label_tokens`` when given. A count of 0 gives 0."""
    if tokens.weights is not None:
        loss_rows = loss_rows * tokens.weights.reshape(-1).float()
    if spec.reduction == "none":
        return loss_rows.reshape((*tokens.batch_shape, *loss_rows.shape[1:]))
    return _divide(loss_rows.sum(), _denominator(tokens, spec))
