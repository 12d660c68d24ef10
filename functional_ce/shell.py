"""The eager shell shared by both loss forms: checks, masking and chunk sizing before the chunk
loop, and weights plus the reduction after it."""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

import torch

from .options import (
    ChunkOptions,
    ChunkSize,
    check_label_range,
    check_labels,
    check_reduction,
    check_token_tensor,
    resolve_chunk_size,
)

Count = Union[int, float, torch.Tensor, None]


@dataclasses.dataclass(frozen=True)
class LossPlan:
    """What the chunk loop and the reduction need, once the inputs are checked.

    Attributes:
        opts: the per-chunk options.
        labels: ``[N]`` int64, ``opts.ignore_index`` wherever the label was ignored or masked.
        batch_shape: the caller's token shape ``[...]`` (``N`` is its product).
        chunk_rows: token rows per chunk, in ``[1, max(N, 1)]``.
        weights: ``[...]`` per-token multipliers or None.
        reduction: ``"mean"``, ``"sum"`` or ``"none"``.
        num_label_tokens: the denominator of a scalar reduction, or None.
    """

    opts: ChunkOptions
    labels: torch.Tensor
    batch_shape: torch.Size
    chunk_rows: int
    weights: Optional[torch.Tensor]
    reduction: str
    num_label_tokens: Count


def check_compile_chunks(compile_chunks: object) -> Optional[bool]:
    if compile_chunks is not None and not isinstance(compile_chunks, bool):
        raise TypeError(f"compile_chunks must be True, False or None, got {compile_chunks!r}")
    return compile_chunks


def plan_loss(
    labels: object,
    *,
    batch_shape: torch.Size,
    n_classes: int,
    device: torch.device,
    what: str,
    ignore_index: int,
    mask: Optional[torch.Tensor],
    weights: Optional[torch.Tensor],
    reduction: str,
    num_label_tokens: Count,
    label_smoothing: float,
    z_loss: float,
    softcap: Optional[float],
    chunk_size: ChunkSize,
    auto_chunk_bytes: Optional[int] = None,
    auto_chunk_rows: Optional[int] = None,
    row_classes: Optional[int] = None,
) -> LossPlan:
    """Check every argument but the float input(s) and turn them into a :class:`LossPlan`.

    ``what`` names the float input (``"logits"`` / ``"hidden"``) in error messages;
    ``auto_chunk_bytes`` is the fp32 ``[chunk_rows, n_classes]`` budget of ``chunk_size="auto"``
    (default :data:`~functional_ce.options.AUTO_CHUNK_BYTES`) and ``auto_chunk_rows`` the rows it
    aims for within that budget (None: as many as fit). ``row_classes`` is how many columns one
    chunk row holds (default ``n_classes``; this process's slice under vocabulary parallelism).
    """
    labels = check_labels(labels, batch_shape, device, what)
    check_token_tensor("mask", mask, batch_shape, device)
    check_token_tensor("weights", weights, batch_shape, device)
    check_reduction(reduction, num_label_tokens)
    opts = ChunkOptions(ignore_index, label_smoothing, z_loss, softcap)
    check_label_range(labels, n_classes, opts.ignore_index)
    labels1d = labels.reshape(-1).long()
    if mask is not None:
        labels1d = torch.where(mask.reshape(-1).bool(), labels1d, opts.ignore_index)
    row_bytes = (n_classes if row_classes is None else row_classes) * 4
    rows = resolve_chunk_size(chunk_size, labels1d.shape[0], row_bytes, auto_chunk_bytes, auto_chunk_rows)
    return LossPlan(opts, labels1d, batch_shape, rows, weights, reduction, num_label_tokens)


def _denominator(plan: LossPlan) -> Union[float, torch.Tensor, None]:
    """What the weighted sum is divided by: None for a plain sum."""
    if plan.num_label_tokens is not None:
        return plan.num_label_tokens
    if plan.reduction == "mean":
        return (plan.labels != plan.opts.ignore_index).sum()
    return None


def _divide(x: torch.Tensor, count: Union[float, torch.Tensor, None]) -> torch.Tensor:
    """``x / count``, 0 where the count is 0."""
    if count is None:
        return x
    if isinstance(count, torch.Tensor):
        n = count.reshape(()).to(device=x.device, dtype=torch.float32)
        return torch.where(n > 0, x / torch.where(n > 0, n, 1.0), 0.0)
    return x / float(count) if count > 0 else x * 0.0


def row_coefficients(plan: LossPlan, device: torch.device) -> torch.Tensor:
    """``[N]`` fp32: each row's factor in the scalar loss (weight over denominator, 0 if ignored),
    so that the reduction equals ``sum(coef * loss_rows)``."""
    valid = (plan.labels != plan.opts.ignore_index).float()
    if plan.weights is not None:
        valid = valid * plan.weights.reshape(-1).float()
    return _divide(valid.to(device), _denominator(plan))


def reduce_rows(loss_rows: torch.Tensor, plan: LossPlan) -> torch.Tensor:
    """Weights, then the reduction, over fp32 per-row losses ``[N]`` (0 on ignored rows).

    ``"mean"`` divides the weighted sum by ``num_label_tokens`` when given, else by the number
    of valid tokens; ``"sum"`` divides by ``num_label_tokens`` when given. A count of 0 (or no
    valid token) gives 0.
    """
    if plan.weights is not None:
        loss_rows = loss_rows * plan.weights.reshape(-1).float()
    if plan.reduction == "none":
        return loss_rows.reshape(plan.batch_shape)
    return _divide(loss_rows.sum(), _denominator(plan))
