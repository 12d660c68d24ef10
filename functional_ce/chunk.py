"""The per-chunk cross-entropy maths: pure functions, the graphs that torch.compile sees.

Each function takes one chunk of rows ``[c, V]`` in the input dtype and works in fp32.
Backward uses the closed-form gradient and recomputes the softmax from the saved
``logsumexp``; nothing here calls autograd. Under vocabulary parallelism a chunk holds the
columns ``[opts.vocab_start, opts.vocab_start + V_local)`` of ``opts.n_classes``:
:func:`chunk_stats` gives the per-slice statistics that are combined across processes, and
:func:`chunk_backward` is exact on the slice once given the global ``logsumexp``.
"""

from __future__ import annotations

import torch

from .options import ChunkOptions


def _capped_fp32(logits_chunk: torch.Tensor, opts: ChunkOptions) -> torch.Tensor:
    x = logits_chunk.float()
    if opts.softcap is not None:
        x = torch.tanh(x / opts.softcap) * opts.softcap
    return x


def chunk_forward(
    logits_chunk: torch.Tensor, labels_chunk: torch.Tensor, *, opts: ChunkOptions
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row loss and logsumexp of one chunk.

    Args:
        logits_chunk: ``[c, V]`` fp32, bf16 or fp16.
        labels_chunk: ``[c]`` integer class ids; ``opts.ignore_index`` marks rows without loss.
        opts: the loss options.

    Returns:
        ``(loss_rows, lse)``, both fp32 ``[c]``. ``loss_rows`` is 0 on ignored rows. ``lse`` is
        the logsumexp of the (soft-capped) logits, what :func:`chunk_backward` needs.
    """
    x = _capped_fp32(logits_chunk, opts)
    lse = torch.logsumexp(x, dim=-1)
    valid = labels_chunk != opts.ignore_index
    safe = torch.where(valid, labels_chunk, 0).long()
    target = x.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    loss = lse - target
    if opts.label_smoothing > 0.0:
        eps = opts.label_smoothing
        loss = (1.0 - eps) * loss + eps * (lse - x.mean(dim=-1))
    if opts.z_loss > 0.0:
        loss = loss + opts.z_loss * lse * lse
    return torch.where(valid, loss, 0.0), lse


def chunk_stats(
    logits_chunk: torch.Tensor, labels_chunk: torch.Tensor, *, opts: ChunkOptions
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What one vocabulary slice of a chunk contributes to each row's loss.

    Args:
        logits_chunk: ``[c, V_local]``, the columns ``[opts.vocab_start, opts.vocab_start + V_local)``
            of the full vocabulary, fp32, bf16 or fp16.
        labels_chunk: ``[c]`` global class ids or ``opts.ignore_index``.
        opts: the loss options.

    Returns:
        ``(lse, target, total)``, fp32 ``[c]`` each: the logsumexp of the slice's (soft-capped)
        logits, the target's logit where the target lies in the slice (else 0), and the sum of
        the slice's logits (what label smoothing needs). Summing ``exp(lse)``, ``target`` and
        ``total`` over all slices gives the full-vocabulary quantities.
    """
    x = _capped_fp32(logits_chunk, opts)
    local = labels_chunk.long() - opts.vocab_start
    here = (labels_chunk != opts.ignore_index) & (local >= 0) & (local < x.shape[-1])
    target = x.gather(-1, torch.where(here, local, 0).unsqueeze(-1)).squeeze(-1)
    return torch.logsumexp(x, dim=-1), torch.where(here, target, 0.0), x.sum(dim=-1)


def chunk_backward(
    logits_chunk: torch.Tensor,
    labels_chunk: torch.Tensor,
    lse: torch.Tensor,
    grad_rows: torch.Tensor,
    *,
    opts: ChunkOptions,
) -> torch.Tensor:
    """Gradient of ``sum(grad_rows * loss_rows)`` with respect to one chunk of logits.

    Args:
        logits_chunk: ``[c, V]``, the same values :func:`chunk_forward` saw (or the
            vocabulary slice that :func:`chunk_stats` saw).
        labels_chunk: ``[c]`` integer class ids.
        lse: ``[c]`` fp32 from :func:`chunk_forward` (the full vocabulary's logsumexp).
        grad_rows: ``[c]`` fp32 upstream gradient of each row's loss.
        opts: the loss options.

    Returns:
        ``[c, V]`` in ``logits_chunk.dtype``; zero on ignored rows.
    """
    x = _capped_fp32(logits_chunk, opts)
    valid = labels_chunk != opts.ignore_index
    safe = torch.where(valid, labels_chunk, 0).long()
    g = torch.where(valid, grad_rows.float(), 0.0)
    eps = opts.label_smoothing
    p_scale = g * (1.0 + 2.0 * opts.z_loss * lse) if opts.z_loss > 0.0 else g
    probs = torch.exp(x - lse.unsqueeze(-1))
    # int32 class ids (vocabularies are < 2**31): the [c, V] comparison vectorises twice as wide
    # as in int64 (10% of the compiled chunk on CPU)
    cols = torch.arange(x.shape[-1], device=x.device, dtype=torch.int32) + opts.vocab_start
    hit = cols.unsqueeze(0) == safe.int().unsqueeze(-1)
    grad = probs * p_scale.unsqueeze(-1) - torch.where(hit, (g * (1.0 - eps)).unsqueeze(-1), 0.0)
    if eps > 0.0:
        grad = grad - (g * (eps / (opts.n_classes or x.shape[-1]))).unsqueeze(-1)
    if opts.softcap is not None:
        t = x / opts.softcap
        grad = grad * (1.0 - t * t)
    grad = torch.where(valid.unsqueeze(-1), grad, 0.0)
    return grad.to(logits_chunk.dtype)
