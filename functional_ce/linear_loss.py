"""``linear_cross_entropy``: the eager shell around the hidden-state chunked operator."""

from __future__ import annotations

from typing import Optional

import torch

from . import linear_fused, linear_ops
from .options import ChunkSize, Reduction, check_float, is_dtensor
from .shell import Count, check_compile_chunks, plan_loss, reduce_rows, row_coefficients

#: ``chunk_size="auto"`` for the hidden-state loss is set by matmul efficiency within a memory
#: cap: chunks of ``LINEAR_AUTO_CHUNK_ROWS`` token rows, the size from which the chunk's three
#: ``[rows, H] x [H, V]``-sized matmuls run at the machine's full rate (see bench/RESULTS.md,
#: ``lce`` section), and fewer rows only where one fp32 ``[rows, V]`` chunk would pass
#: ``LINEAR_AUTO_CHUNK_BYTES`` (large vocabularies). These are the CPU values.
LINEAR_AUTO_CHUNK_ROWS = 512
LINEAR_AUTO_CHUNK_BYTES = 64 * 1024 * 1024
#: The same on CUDA, where two costs grow as chunks shrink: each chunk adds its weight-gradient
#: partial into the ``[V, H]`` fp32 accumulator (8 bytes of memory traffic per weight element,
#: hidden behind the matmul only when the chunk has about ``4 x FLOP/s / (bytes/s)`` rows: about
#: 700 on an H100/H200), and a GPU needs large matmuls to fill its multiprocessors. The row
#: count is the knee of the chunk sweep in bench/RESULTS.md (``lce``, GPU); the byte cap keeps one
#: fp32 chunk at most 1 GiB (2048 rows of a 128K vocabulary).
LINEAR_AUTO_CHUNK_ROWS_CUDA = 2048
LINEAR_AUTO_CHUNK_BYTES_CUDA = 1024 * 1024 * 1024


def linear_auto_chunk(device: torch.device) -> tuple[int, int]:
    """``(rows, fp32 chunk byte cap)`` of ``chunk_size="auto"`` on ``device``."""
    if device.type == "cuda":
        return LINEAR_AUTO_CHUNK_ROWS_CUDA, LINEAR_AUTO_CHUNK_BYTES_CUDA
    return LINEAR_AUTO_CHUNK_ROWS, LINEAR_AUTO_CHUNK_BYTES


def _check_linear_inputs(hidden: object, weight: object, bias: object) -> None:
    hidden = check_float("hidden", hidden)
    weight = check_float("weight", weight)
    if hidden.dim() < 1:
        raise ValueError("hidden must have at least one dim [..., H], got a 0-dim tensor")
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [V, H] (an lm_head weight), got shape {tuple(weight.shape)}")
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight must be [V, H] with H = hidden.shape[-1] = {hidden.shape[-1]}, got weight shape "
            f"{tuple(weight.shape)}; pass the [vocab, hidden] weight (not its transpose)"
        )
    if weight.shape[0] == 0:
        raise ValueError("weight must have at least one row (V >= 1), got V=0")
    if weight.dtype != hidden.dtype:
        raise TypeError(
            f"hidden and weight must have one dtype, got hidden {hidden.dtype} and weight {weight.dtype}; "
            "cast one of them (e.g. hidden.to(weight.dtype))"
        )
    if weight.device != hidden.device:
        raise ValueError(f"hidden is on {hidden.device} but weight is on {weight.device}; move both to one device")
    if bias is None:
        return
    bias = check_float("bias", bias)
    if bias.shape != weight.shape[:1]:
        raise ValueError(f"bias must have shape ({weight.shape[0]},) (one value per class), got {tuple(bias.shape)}")
    if bias.dtype != weight.dtype:
        raise TypeError(f"bias must have the weight's dtype {weight.dtype}, got {bias.dtype}")
    if bias.device != weight.device:
        raise ValueError(f"bias is on {bias.device} but weight is on {weight.device}")


def _autocast_inputs(hidden: object, weight: object, bias: object) -> tuple:
    """Under ``torch.autocast``, cast like ``F.linear`` would: hidden, weight and bias to the
    autocast dtype. Forward and the backward recomputation then see the same low-precision
    operands, and autograd casts the gradients back to the parameters' dtype."""
    if not isinstance(hidden, torch.Tensor) or not isinstance(weight, torch.Tensor):
        return hidden, weight, bias
    device_type = hidden.device.type
    if device_type not in ("cpu", "cuda", "xpu") or not torch.is_autocast_enabled(device_type):
        return hidden, weight, bias
    dtype = torch.get_autocast_dtype(device_type)
    if not (hidden.is_floating_point() and weight.is_floating_point()):
        return hidden, weight, bias
    cast = lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t  # noqa: E731
    return cast(hidden), cast(weight), cast(bias)


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: Optional[torch.Tensor] = None,
    ignore_index: int = -100,
    mask: Optional[torch.Tensor] = None,
    weights: Optional[torch.Tensor] = None,
    reduction: Reduction = "mean",
    num_label_tokens: Count = None,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: Optional[float] = None,
    chunk_size: ChunkSize = "auto",
    compile_chunks: Optional[bool] = None,
    recompute_logits_in_backward: bool = False,
) -> torch.Tensor:
    """Cross-entropy of the logits ``hidden @ weight.T + bias`` without ever building them.

    Same result as ``functional_ce.cross_entropy(F.linear(hidden, weight, bias), labels, ...)``
    (fp32 loss maths), but no ``[N, V]`` tensor is allocated in forward or backward: each chunk
    of ``chunk_size`` token rows computes its ``[c, V]`` logits, its loss and ``logsumexp``, and
    drops them; rows whose label is ignored take part in no matmul. With ``"mean"`` / ``"sum"``
    and gradients required, forward also computes the gradients for a unit upstream gradient
    (three matmuls per chunk in all) and backward scales them; otherwise (``"none"``, or
    ``recompute_logits_in_backward=True``) autograd saves only ``hidden``, ``weight``, ``bias``,
    the labels and one fp32 ``logsumexp`` per row, and backward recomputes each chunk's logits.
    The weight and bias gradients are accumulated in fp32 and returned in the weight's dtype.

    Args:
        hidden: ``[..., H]`` float32, bfloat16 or float16 (e.g. the decoder's last hidden state).
        weight: ``[V, H]`` of ``hidden``'s dtype and device (an ``lm_head.weight``).
        labels: ``[...]`` int64 or int32 class ids in ``[0, V)``, or ``ignore_index``.
        bias: ``[V]`` or None.
        ignore_index, mask, weights, reduction, num_label_tokens, label_smoothing, z_loss, softcap:
            as in :func:`functional_ce.cross_entropy`.
        chunk_size: token rows per chunk. ``"auto"`` takes ``LINEAR_AUTO_CHUNK_ROWS`` rows (where
            the matmuls reach full rate), fewer where one fp32 ``[c, V]`` chunk would pass
            ``LINEAR_AUTO_CHUNK_BYTES`` (on CUDA: the ``*_CUDA`` values, see
            :func:`linear_auto_chunk`); ``None`` is one chunk; an int is rows per chunk.
        compile_chunks: run the per-chunk maths as compiled graphs (default: on, unless the
            environment sets ``FUNCTIONAL_CE_COMPILE=0``); a configuration falls back to eager
            only if the compiler itself fails, with a warning naming the cause.
        recompute_logits_in_backward: with a scalar reduction and gradients required, the
            default computes each chunk's logits once and the gradients (for a unit upstream
            gradient) already in forward, holding ``[N, H]`` + ``[V, H]`` gradients until
            backward scales them by the upstream gradient. True saves only O(N) statistics and
            recomputes each chunk's logits in backward (one more matmul per chunk), as
            ``reduction="none"`` always does.

    Returns:
        fp32 scalar for ``"mean"`` (the default) / ``"sum"``; fp32 ``[...]`` for ``"none"``.

    Tensor parallel: ``weight`` (and ``bias``) may be a DTensor ``Shard(0)`` over one mesh dim (a
    column-parallel LM head) with ``hidden`` a DTensor on the same mesh, ``Replicate()`` or sharded
    over a token dim (sequence parallel); the result is a DTensor ``Replicate()``. Each process
    builds only its slice of each chunk's logits; backward always recomputes them there (the
    statistics are combined across processes before any gradient exists), and DTensor reduces
    the hidden gradient once. See :mod:`functional_ce.vocab_parallel`.

    FSDP2: ``weight`` (and ``bias``) may be DTensors sharded on dim 0 (``Replicate()`` on an HSDP
    replicate dim) while ``hidden`` is a plain tensor. The full weight is gathered for the step
    (one all-gather, one full ``[V, H]`` weight held until backward, as FSDP's own unshard
    does), the loss is this process's own (a plain tensor), and ``weight.grad`` is the **sum** over
    processes of each process's gradient, sharded like the weight (a reduce-scatter): not divided
    by the number of processes, unlike FSDP2's own gradient reduction. The layout cannot tell a
    tensor-parallel weight from an FSDP2 one: with a vocabulary-sharded weight, pass ``hidden`` as
    a DTensor (above), or the gradient is the sum of identical per-process gradients.

    Under ``torch.autocast``, hidden, weight and bias are first cast to the autocast dtype, as
    ``F.linear`` would cast them; their gradients come back in their own dtype.

    Raises:
        TypeError / ValueError: for inputs of the wrong type, shape, dtype, device or range
        (labels outside ``[0, V)`` are checked in eager mode only, as in ``cross_entropy``).
    """
    hidden, weight, bias = _autocast_inputs(hidden, weight, bias)
    _check_linear_inputs(hidden, weight, bias)
    check_compile_chunks(compile_chunks)
    if not isinstance(recompute_logits_in_backward, bool):
        raise TypeError(f"recompute_logits_in_backward must be a bool, got {recompute_logits_in_backward!r}")
    auto_rows, auto_bytes = linear_auto_chunk(hidden.device)
    if is_dtensor(hidden):
        from .vocab_parallel import vocab_parallel_linear_cross_entropy

        return vocab_parallel_linear_cross_entropy(
            hidden, weight, labels, bias=bias, ignore_index=ignore_index, mask=mask, weights=weights,
            reduction=reduction, num_label_tokens=num_label_tokens, label_smoothing=label_smoothing, z_loss=z_loss,
            softcap=softcap, chunk_size=chunk_size, compile_chunks=compile_chunks,
            auto_chunk_bytes=auto_bytes, auto_chunk_rows=auto_rows,
        )
    if is_dtensor(weight) or is_dtensor(bias):  # FSDP2: sharded parameters, plain activations
        from .sharded_weight import gathered_parameter

        weight = gathered_parameter(weight, "weight") if is_dtensor(weight) else weight
        bias = gathered_parameter(bias, "bias") if is_dtensor(bias) else bias
    n_classes, width = weight.shape
    plan = plan_loss(
        labels, batch_shape=hidden.shape[:-1], n_classes=n_classes, device=hidden.device, what="hidden",
        ignore_index=ignore_index, mask=mask, weights=weights, reduction=reduction,
        num_label_tokens=num_label_tokens, label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap,
        chunk_size=chunk_size, auto_chunk_bytes=auto_bytes, auto_chunk_rows=auto_rows,
    )
    hidden2d = hidden.reshape(-1, width)
    needs = (hidden.requires_grad, weight.requires_grad, bias is not None and bias.requires_grad)
    if plan.reduction != "none" and not recompute_logits_in_backward and torch.is_grad_enabled() and any(needs):
        coef = row_coefficients(plan, hidden.device)
        loss, *_ = linear_fused.linear_ce_fused(
            hidden2d, weight, bias, plan.labels, coef, *plan.opts.op_args(), plan.chunk_rows, compile_chunks, *needs
        )
        return loss
    loss_rows, _ = linear_ops.linear_ce_forward(
        hidden2d, weight, bias, plan.labels, *plan.opts.op_args(), plan.chunk_rows, compile_chunks
    )
    return reduce_rows(loss_rows, plan)
