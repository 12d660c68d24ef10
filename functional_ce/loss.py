"""``cross_entropy``: the eager shell around the chunked operator (checks, masking, reduction)."""

from __future__ import annotations

from typing import Optional

import torch

from . import ops
from .options import ChunkSize, Reduction, check_float, is_dtensor
from .shell import Count, check_compile_chunks, plan_loss, reduce_rows


def cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    mask: Optional[torch.Tensor] = None,
    weights: Optional[torch.Tensor] = None,
    reduction: Reduction = "mean",
    num_label_tokens: Count = None,
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
        reduction: ``"mean"`` (default, as in torch), the weighted sum divided by the number of
            valid tokens (0 when there are none); ``"sum"``; ``"none"``, fp32 ``[...]`` per
            token, 0 where ignored.
        num_label_tokens: the denominator of the summed loss, with ``"mean"`` (replacing the
            valid-token count: gradient accumulation, data parallel) or ``"sum"`` (the
            sum-then-divide form); 0 gives loss 0 and zero gradients. A finite number >= 0, or a
            one-element tensor: its value is checked in eager mode (a device read-back) and not
            under torch.compile. Not allowed with ``"none"``.
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
            gradient either way, so the logits are left intact. Double backward raises, as it
            does without it.
        compile_chunks: run the per-chunk maths as compiled graphs (default: on, unless the
            environment sets ``FUNCTIONAL_CE_COMPILE=0``); a configuration falls back to eager
            only if the compiler itself fails, with a warning naming the cause.

    Returns:
        fp32 scalar for ``"mean"`` (the default) / ``"sum"``; fp32 ``[...]`` for ``"none"``.

    Tensor parallel: ``logits`` may be a DTensor sharded over the vocabulary (``Shard(-1)`` on one
    mesh dim, ``Replicate()`` on the others; uneven shards allowed). Each process then works on
    its own shard, forward adds two all-reduces of O(N) fp32 statistics, backward communicates
    nothing, every option keeps its meaning over the full vocabulary, and the result is a
    DTensor ``Replicate()``. ``labels``, ``mask`` and ``weights`` are then plain tensors equal on
    every process or ``Replicate()`` DTensors. See :mod:`functional_ce.vocab_parallel`.

    Raises:
        TypeError / ValueError: for inputs of the wrong type, shape, dtype, device or range. Labels
        outside ``[0, V)`` are checked in eager mode only; under torch.compile they are not
        checked and give an indexing error (CPU) or a device-side assert (CUDA).
    """
    logits = check_float("logits", logits)
    if logits.dim() < 1:
        raise ValueError("logits must have at least one dim [..., V], got a 0-dim tensor")
    n_classes = logits.shape[-1]
    if n_classes == 0:
        raise ValueError("logits must have at least one class (last dim V >= 1), got V=0")
    if not isinstance(inplace_grad, bool):
        raise TypeError(f"inplace_grad must be a bool, got {inplace_grad!r}")
    check_compile_chunks(compile_chunks)
    if inplace_grad and torch.compiler.is_compiling():
        # Functionalization would clone the logits and still destroy them: keep them instead
        # (documented; dynamo cannot trace a logging call here without a graph break).
        inplace_grad = False
    if is_dtensor(logits):
        from .vocab_parallel import vocab_parallel_cross_entropy

        return vocab_parallel_cross_entropy(
            logits, labels, ignore_index=ignore_index, mask=mask, weights=weights, reduction=reduction,
            num_label_tokens=num_label_tokens, label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap,
            chunk_size=chunk_size, inplace_grad=inplace_grad, compile_chunks=compile_chunks,
        )
    plan = plan_loss(
        labels, batch_shape=logits.shape[:-1], n_classes=n_classes, device=logits.device, what="logits",
        ignore_index=ignore_index, mask=mask, weights=weights, reduction=reduction,
        num_label_tokens=num_label_tokens, label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap,
        chunk_size=chunk_size,
    )
    loss_rows, _ = ops.chunked_ce_forward(
        logits.reshape(-1, n_classes), plan.labels, *plan.opts.op_args(), plan.chunk_rows, compile_chunks,
        inplace_grad,
    )
    return reduce_rows(loss_rows, plan)
