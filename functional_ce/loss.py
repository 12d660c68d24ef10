"""The public loss functions: checks of the float inputs, the spec, then the chunk driver.

Their keyword options are declared once, on :class:`~functional_ce.spec.LossSpec` (and the
per-batch ``mask``, ``weights``, ``num_label_tokens`` and ``chunk_size``); each function's
signature lists them (:func:`~functional_ce.spec.keyword_signature`).
"""

from __future__ import annotations

from typing import Any

import torch

from . import operators
from .inputs import autocast_inputs, check_float, check_linear_inputs, make_spec
from .spec import keyword_signature


def is_dtensor(t: object) -> bool:
    """``t`` is a ``torch.distributed.tensor.DTensor`` (False where torch has no distributed support)."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, **options: Any) -> torch.Tensor:
    """Cross-entropy of ``logits`` against integer ``labels`` in fp32, chunk by chunk.

    Same result as ``F.cross_entropy(logits.float().reshape(-1, V), labels.reshape(-1), ...)``
    with the options below, without an ``[N, V]`` fp32 copy: forward and backward each hold at
    most a few fp32 chunks of ``chunk_size x V`` plus O(N) fp32 row statistics. Autograd saves the
    caller's logits (not a copy), the labels and the fp32 ``logsumexp`` per row.

    Args:
        logits: ``[..., V]`` float32, bfloat16 or float16, any strides.
        labels: ``[...]`` int64 or int32 class ids in ``[0, V)``, or ``ignore_index``.
        ignore_index: label value that contributes no loss and gets zero gradient (default -100).
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
        inplace_grad: backward writes the logits' gradient into the logits' own storage and
            returns it, so no new ``[N, V]`` buffer is allocated. **The logits are destroyed in
            backward**: do not read them afterwards, and do not use this when another autograd
            node saved them (autograd then raises a version error). Inside ``torch.compile`` it is
            ignored: the compiled backward allocates the gradient either way, so the logits are
            left intact. Double backward raises, as it does without it.
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
    every process or ``Replicate()`` DTensors. See :mod:`functional_ce.distributed.vocab`.

    Raises:
        TypeError / ValueError: for inputs of the wrong type, shape, dtype, device or range, or an
            unknown keyword. Labels outside ``[0, V)`` are checked in eager mode only; under
            torch.compile they are not checked and give an indexing error (CPU) or a device-side
            assert (CUDA).
    """
    logits = check_float("logits", logits)
    if logits.dim() < 1:
        raise ValueError("logits must have at least one dim [..., V], got a 0-dim tensor")
    n_classes = logits.shape[-1]
    if n_classes == 0:
        raise ValueError("logits must have at least one class (last dim V >= 1), got V=0")
    if is_dtensor(logits):
        from .distributed.vocab import vocab_parallel_loss

        return vocab_parallel_loss("logits", logits, None, None, labels, options)
    spec, tokens = make_spec("logits", options, labels, batch_shape=logits.shape[:-1], n_classes=n_classes,
                             device=logits.device)
    return operators.loss_rows(logits.reshape(-1, n_classes), None, None, tokens, spec)


def gathered_head(weight: Any, bias: Any) -> tuple:
    """FSDP2 (sharded parameters, plain activations): the full weight and bias of a head whose
    parameters are DTensors, gathered for the call; plain tensors as they are."""
    if not (is_dtensor(weight) or is_dtensor(bias)):
        return weight, bias
    from .distributed.fsdp import gathered_parameter

    return (gathered_parameter(weight, "weight") if is_dtensor(weight) else weight,
            gathered_parameter(bias, "bias") if is_dtensor(bias) else bias)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                         bias: torch.Tensor | None = None, **options: Any) -> torch.Tensor:
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
        **options: ``ignore_index``, ``mask``, ``weights``, ``reduction``, ``num_label_tokens``,
            ``label_smoothing``, ``z_loss``, ``softcap``, ``compile_chunks``: as in
            :func:`functional_ce.cross_entropy`; ``chunk_size`` and ``recompute_logits_in_backward``
            below.
        chunk_size: token rows per chunk. ``"auto"`` takes ``LINEAR_AUTO_CHUNK_ROWS`` rows (where
            the matmuls reach full rate), fewer where one fp32 ``[c, V]`` chunk would pass
            ``LINEAR_AUTO_CHUNK_BYTES`` (on CUDA: the ``*_CUDA`` values, see
            :func:`functional_ce.spec.linear_auto_chunk`); ``None`` is one chunk; an int is rows
            per chunk.
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
    the hidden gradient once. See :mod:`functional_ce.distributed.vocab`.

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
        TypeError / ValueError: for inputs of the wrong type, shape, dtype, device or range, or an
            unknown keyword (labels outside ``[0, V)`` are checked in eager mode only, as in
            ``cross_entropy``).
    """
    hidden, weight, bias = autocast_inputs(hidden, weight, bias)
    check_linear_inputs(hidden, weight, bias)
    if is_dtensor(hidden):
        from .distributed.vocab import vocab_parallel_loss

        return vocab_parallel_loss("linear", hidden, weight, bias, labels, options)
    weight, bias = gathered_head(weight, bias)
    n_classes, width = weight.shape
    spec, tokens = make_spec("linear", options, labels, batch_shape=hidden.shape[:-1], n_classes=n_classes,
                             device=hidden.device)
    return operators.loss_rows(hidden.reshape(-1, width), weight, bias, tokens, spec)


keyword_signature(cross_entropy, "logits")
keyword_signature(linear_cross_entropy, "linear")
