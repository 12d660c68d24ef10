"""``cross_entropy``: the eager shell around the chunked operator (checks, masking, reduction)."""

from __future__ import annotations

import numbers
from typing import Optional, Union

import torch

from .options import (
    ChunkOptions,
    ChunkSize,
    Reduction,
    check_float,
    check_label_range,
    check_labels,
    check_reduction,
    check_token_tensor,
    resolve_chunk_size,
)
from . import ops


def cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    mask: Optional[torch.Tensor] = None,
    weights: Optional[torch.Tensor] = None,
    reduction: Reduction = "sum",
    num_label_tokens: Union[int, float, torch.Tensor, None] = None,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: Optional[float] = None,
    chunk_size: ChunkSize = "auto",
    inplace_grad: bool = False,
    compile_chunks: Optional[bool] = None,
) -> torch.Tensor:
    """Cross-entropy of ``logits`` against integer ``labels`` in fp32, chunk by chunk.

    Same result as ``F.cross_entropy(logits.float().reshape(-1, V), labels.reshape(-1), ...)``
    with the options below, without an ``[N, V]`` fp32 copy: forward and backward each hold at
    most a few fp32 chunks of ``chunk_size x V`` plus O(N) fp32 row statistics. Autograd saves the
    caller's logits (not a copy), the labels and the fp32 ``logsumexp`` per row.

    Args:
        logits: ``[..., V]`` float32, bfloat16 or float16, any strides.
        labels: ``[...]`` int64 or int32 class ids in ``[0, V)``, or ``ignore_index``.
        ignore_index: label value that contributes no loss and gets zero gradient.
        mask: ``[...]`` bool or 0/1; positions where it is zero are ignored like ``ignore_index``.
        weights: ``[...]`` float per-token loss multipliers (applied after the per-token loss).
        reduction: ``"sum"``; ``"mean"``, the weighted sum divided by the number of valid tokens
            (0 when there are none); ``"none"``, fp32 ``[...]`` per token, 0 where ignored.
        num_label_tokens: divide the summed loss by this count (gradient accumulation, data
            parallel); 0 gives loss 0 and zero gradients. Needs ``reduction="sum"``.
        label_smoothing: in [0, 1], the definition of ``torch.nn.functional.cross_entropy``:
            ``(1 - eps) * nll + eps * mean_j(-log p_j)``. A ``-inf`` logit makes that term
            infinite, exactly as in torch.
        z_loss: adds ``z_loss * logsumexp(logits) ** 2`` per valid token.
        softcap: if set, logits become ``softcap * tanh(logits / softcap)`` first (Gemma 2/3).
        chunk_size: rows per fp32 chunk. ``"auto"`` bounds one fp32 chunk to about 256 MiB;
            ``None`` is one chunk; an int is rows per chunk.
        inplace_grad: keyword-only. Backward writes the logits' gradient into the logits'
            own storage and returns it, so no new ``[N, V]`` buffer is allocated. **The logits
            are destroyed in backward**: do not read them afterwards, and do not use this when
            another autograd node saved them (autograd then raises a version error). Inside
            ``torch.compile`` it is ignored: the compiled backward allocates the
            gradient either way, so the logits are left intact.
        compile_chunks: run the per-chunk maths as compiled graphs (default: on, unless the
            environment sets ``FUNCTIONAL_CE_COMPILE=0``); falls back to eager if compiling fails.

    Returns:
        fp32 scalar for ``"sum"`` / ``"mean"``; fp32 ``[...]`` for ``"none"``.

    Raises:
        TypeError / ValueError: for inputs of the wrong type, shape, dtype, device or range. Labels
        outside ``[0, V)`` are checked in eager mode only; under torch.compile they are not
        checked and give an indexing error (CPU) or a device-side assert (CUDA).
    """
    logits = check_float("logits", logits)
    if logits.dim() < 1:
        raise ValueError("logits must have at least one dim [..., V], got a 0-dim tensor")
    batch_shape = logits.shape[:-1]
    n_classes = logits.shape[-1]
    labels = check_labels(labels, batch_shape, logits.device, "logits")
    check_token_tensor("mask", mask, batch_shape, logits.device)
    check_token_tensor("weights", weights, batch_shape, logits.device)
    check_reduction(reduction, num_label_tokens)
    if not isinstance(inplace_grad, bool):
        raise TypeError(f"inplace_grad must be a bool, got {inplace_grad!r}")
    opts = ChunkOptions(ignore_index, label_smoothing, z_loss, softcap)
    if n_classes == 0:
        raise ValueError("logits must have at least one class (last dim V >= 1), got V=0")
    check_label_range(labels, n_classes, opts.ignore_index)

    logits2d = logits.reshape(-1, n_classes)
    labels1d = labels.reshape(-1).long()
    if mask is not None:
        labels1d = torch.where(mask.reshape(-1).bool(), labels1d, opts.ignore_index)
    rows = resolve_chunk_size(chunk_size, labels1d.shape[0], n_classes * 4)
    if inplace_grad and torch.compiler.is_compiling():
        # Functionalization would clone the logits and still destroy them: keep them instead
        # (documented; dynamo cannot trace a logging call here without a graph break).
        inplace_grad = False
    loss_rows, _ = ops.chunked_ce_forward(
        logits2d,
        labels1d,
        opts.ignore_index,
        opts.label_smoothing,
        opts.z_loss,
        opts.softcap or 0.0,
        rows,
        -1 if compile_chunks is None else int(bool(compile_chunks)),
        inplace_grad,
    )
    return reduce_rows(loss_rows, labels1d, opts.ignore_index, batch_shape, weights, reduction, num_label_tokens)


def reduce_rows(
    loss_rows: torch.Tensor,
    labels1d: torch.Tensor,
    ignore_index: int,
    batch_shape: torch.Size,
    weights: Optional[torch.Tensor],
    reduction: str,
    num_label_tokens: Union[int, float, torch.Tensor, None],
) -> torch.Tensor:
    """Weights, then the reduction, over fp32 per-row losses ``[N]`` (0 on ignored rows)."""
    if weights is not None:
        loss_rows = loss_rows * weights.reshape(-1).float()
    if reduction == "none":
        return loss_rows.reshape(batch_shape)
    total = loss_rows.sum()
    if reduction == "mean":
        n_valid = (labels1d != ignore_index).sum()
        return total / n_valid.clamp(min=1).float()
    if num_label_tokens is None:
        return total
    if isinstance(num_label_tokens, torch.Tensor):
        n = num_label_tokens.reshape(()).to(device=total.device, dtype=torch.float32)
        return torch.where(n > 0, total / torch.where(n > 0, n, 1.0), 0.0)
    if num_label_tokens == 0:
        return total * 0.0
    assert isinstance(num_label_tokens, numbers.Real)
    return total / float(num_label_tokens)
