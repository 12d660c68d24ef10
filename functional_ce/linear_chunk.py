"""Per-chunk maths of the hidden-state loss: pure functions, the graphs that torch.compile sees.

One chunk of ``c`` token rows: the chunk's logits ``hidden_c @ weight.T (+ bias)`` exist only
inside these functions (``[c, V]`` in the input dtype) and are handed to the logits form's
:func:`~functional_ce.chunk.chunk_forward` / :func:`~functional_ce.chunk.chunk_backward`, so the
loss maths (label smoothing, z-loss, softcap, ignore_index) is written once. Nothing here calls
autograd; the weight-gradient accumulation across chunks lives in the driver
(:mod:`functional_ce.linear_ops`).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .chunk import chunk_backward, chunk_forward, chunk_stats
from .options import ChunkOptions


def linear_chunk_forward(
    hidden_chunk: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    labels_chunk: torch.Tensor,
    *,
    opts: ChunkOptions,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row loss and logsumexp of one chunk of hidden states.

    Args:
        hidden_chunk: ``[c, H]`` fp32, bf16 or fp16.
        weight: ``[V, H]``, the dtype of ``hidden_chunk``.
        bias: ``[V]`` or None.
        labels_chunk: ``[c]`` integer class ids or ``opts.ignore_index``.
        opts: the loss options.

    Returns:
        ``(loss_rows, lse)``, both fp32 ``[c]``, as :func:`chunk_forward` returns them.
    """
    logits = F.linear(hidden_chunk, weight, bias)
    return chunk_forward(logits, labels_chunk, opts=opts)


def linear_chunk_stats(
    hidden_chunk: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    labels_chunk: torch.Tensor,
    *,
    opts: ChunkOptions,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`~functional_ce.chunk.chunk_stats` of the logits ``hidden_chunk @ weight.T (+ bias)``,
    where ``weight`` ``[V_local, H]`` holds the classes from ``opts.vocab_start`` on."""
    return chunk_stats(F.linear(hidden_chunk, weight, bias), labels_chunk, opts=opts)


def linear_chunk_backward(
    hidden_chunk: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    labels_chunk: torch.Tensor,
    lse: torch.Tensor,
    grad_rows: torch.Tensor,
    *,
    opts: ChunkOptions,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Recompute one chunk's logits and return the gradients that stay chunk-local.

    Args:
        hidden_chunk: ``[c, H]``, the values :func:`linear_chunk_forward` saw.
        weight: ``[V, H]``.
        bias: ``[V]`` or None.
        labels_chunk: ``[c]`` integer class ids.
        lse: ``[c]`` fp32 from :func:`linear_chunk_forward`.
        grad_rows: ``[c]`` fp32 upstream gradient of each row's loss.
        opts: the loss options.

    Returns:
        ``(grad_hidden, grad_logits)``: ``[c, H]`` and ``[c, V]``, both in the input dtype.
        The caller folds ``grad_logits`` into the weight and bias gradients and drops it.
    """
    logits = F.linear(hidden_chunk, weight, bias)
    grad_logits = chunk_backward(logits, labels_chunk, lse, grad_rows, opts=opts)
    return grad_logits @ weight, grad_logits
