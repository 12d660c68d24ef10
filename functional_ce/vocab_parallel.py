"""The two loss forms over a vocabulary sharded with DTensor (tensor parallelism).

``cross_entropy`` and ``linear_cross_entropy`` hand DTensor inputs to the functions here. Each
process runs the chunk loop on its own slice of the vocabulary (the logits' local shard, or the
logits it builds from its rows of the LM head's weight), then two all-reduces over the
vocabulary's mesh dim combine O(N) fp32 statistics per token (:func:`combine_stats`). Every
option keeps its single-process meaning over the full vocabulary. Backward is local: from logits
it needs no communication at all; from hidden states the only one is DTensor's own reduction of
the partial hidden gradient (an all-reduce, or a reduce-scatter under sequence parallelism).
The loss is a DTensor ``Replicate()`` on every mesh dim.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from . import vocab_ops
from .options import ChunkSize, Reduction
from .shell import Count, LossPlan, plan_loss, reduce_rows
from .vocab_layout import (
    LOGITS_LAYOUTS,
    WEIGHT_LAYOUTS,
    VocabSlice,
    combine_stats,
    replicate_result,
    replicated_local,
    vocab_slice,
)


def _local_token_args(mesh: object, *args: object) -> tuple:
    """``labels``, ``mask``, ``weights``, ``num_label_tokens`` as plain local values (see
    :func:`~functional_ce.vocab_layout.replicated_local`)."""
    names = ("labels", "mask", "weights", "num_label_tokens")
    return tuple(replicated_local(name, t, mesh) for name, t in zip(names, args))


def _slice_options(plan: LossPlan, vocab: VocabSlice) -> tuple:
    opts = dataclasses.replace(plan.opts, vocab_start=vocab.start, n_classes=vocab.n_classes)
    return opts, opts.op_args()


def vocab_parallel_cross_entropy(
    logits: DTensor,
    labels: object,
    *,
    ignore_index: int,
    mask: object,
    weights: object,
    reduction: Reduction,
    num_label_tokens: Count,
    label_smoothing: float,
    z_loss: float,
    softcap: Optional[float],
    chunk_size: ChunkSize,
    inplace_grad: bool,
    compile_chunks: Optional[bool],
) -> DTensor:
    """:func:`functional_ce.cross_entropy` of a DTensor ``logits [..., V]`` sharded over the
    vocabulary (see :data:`~functional_ce.vocab_layout.LOGITS_LAYOUTS`).

    ``labels``, ``mask``, ``weights`` and a tensor ``num_label_tokens`` are plain tensors equal on
    every process, or DTensors ``Replicate()`` on the logits' mesh. With ``inplace_grad`` each
    process's gradient shard overwrites its own local logits. Returns a DTensor ``Replicate()``.
    """
    vocab = vocab_slice(logits, -1, "logits", LOGITS_LAYOUTS)
    mesh = vocab.mesh
    labels, mask, weights, num_label_tokens = _local_token_args(mesh, labels, mask, weights, num_label_tokens)
    local = logits.to_local()
    plan = plan_loss(
        labels, batch_shape=logits.shape[:-1], n_classes=vocab.n_classes, device=local.device, what="logits",
        ignore_index=ignore_index, mask=mask, weights=weights, reduction=reduction,
        num_label_tokens=num_label_tokens, label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap,
        chunk_size=chunk_size, row_classes=max(vocab.size, 1),
    )
    opts, args = _slice_options(plan, vocab)
    local2d = local.reshape(plan.labels.shape[0], vocab.size)
    stats = vocab_ops.vocab_slice_stats(local2d.detach(), plan.labels, *args, plan.chunk_rows, compile_chunks)
    lse, target, total = combine_stats(stats, vocab, opts.label_smoothing > 0.0)
    rows = vocab_ops.vocab_slice_rows(
        local2d, plan.labels, lse, target, total, *args, plan.chunk_rows, compile_chunks, inplace_grad
    )
    return replicate_result(reduce_rows(rows, plan), mesh)


def _check_hidden_layout(hidden: object, weight: DTensor, vocab: VocabSlice) -> DTensor:
    if not isinstance(hidden, DTensor):
        raise ValueError(
            "weight is a DTensor but hidden is a plain tensor: the vocabulary-parallel hidden-state loss needs "
            f"hidden as a DTensor on the weight's mesh. Supported: {WEIGHT_LAYOUTS}"
        )
    if hidden.device_mesh != vocab.mesh:
        raise ValueError(f"hidden is on mesh {hidden.device_mesh} but weight is on {vocab.mesh}; use one mesh")
    token_dims = range(hidden.dim() - 1)
    for i, p in enumerate(hidden.placements):
        on_vocab_dim = i == vocab.mesh_dim
        if isinstance(p, Replicate) or (on_vocab_dim and type(p) is Shard and p.dim % hidden.dim() in token_dims):
            continue
        raise ValueError(
            f"hidden has placements {tuple(hidden.placements)} and weight {tuple(weight.placements)}: {p!r} on mesh "
            f"dim {i} is not supported. Supported: {WEIGHT_LAYOUTS}"
        )
    return hidden


def _check_bias_layout(bias: object, weight: DTensor) -> Optional[DTensor]:
    if bias is None:
        return None
    if not isinstance(bias, DTensor) or bias.device_mesh != weight.device_mesh or tuple(bias.placements) != tuple(
        Shard(0) if isinstance(p, Shard) else p for p in weight.placements
    ):
        shown = tuple(bias.placements) if isinstance(bias, DTensor) else "a plain tensor"
        raise ValueError(f"bias must be sharded like the weight {tuple(weight.placements)}, got {shown}")
    return bias


def vocab_parallel_linear_cross_entropy(
    hidden: object,
    weight: object,
    labels: object,
    *,
    bias: object,
    ignore_index: int,
    mask: object,
    weights: object,
    reduction: Reduction,
    num_label_tokens: Count,
    label_smoothing: float,
    z_loss: float,
    softcap: Optional[float],
    chunk_size: ChunkSize,
    compile_chunks: Optional[bool],
    auto_chunk_bytes: int,
    auto_chunk_rows: int,
) -> DTensor:
    """:func:`functional_ce.linear_cross_entropy` with a column-parallel LM head: ``weight [V, H]``
    a DTensor ``Shard(0)``, ``hidden [..., H]`` a DTensor ``Replicate()`` or sharded over a token
    dim (sequence parallel), ``bias`` sharded like the weight (see
    :data:`~functional_ce.vocab_layout.WEIGHT_LAYOUTS`).

    Sequence-parallel tokens are gathered first (DTensor's all-gather of ``[N, H]``); no
    ``[N, V]`` or ``[N, V / p]`` tensor is built. Backward recomputes each chunk's local logits;
    the hidden gradient ``[N, H]`` is reduced once over the vocabulary's mesh dim, by DTensor.
    ``hidden.grad`` has hidden's placements and ``weight.grad`` the weight's. Returns a DTensor
    ``Replicate()``.
    """
    if not isinstance(weight, DTensor):
        raise ValueError(
            "hidden is a DTensor but weight is a plain tensor: the vocabulary-parallel hidden-state loss needs "
            f"the weight as a DTensor. Supported: {WEIGHT_LAYOUTS}"
        )
    vocab = vocab_slice(weight, 0, "weight", WEIGHT_LAYOUTS)
    mesh = vocab.mesh
    hidden = _check_hidden_layout(hidden, weight, vocab)
    bias = _check_bias_layout(bias, weight)
    labels, mask, weights, num_label_tokens = _local_token_args(mesh, labels, mask, weights, num_label_tokens)
    replicate = [Replicate()] * mesh.ndim
    grad_placements = list(replicate)
    if vocab.mesh_dim is not None:
        grad_placements[vocab.mesh_dim] = Partial()  # each process's hidden gradient covers its classes only
    # Redistribute even when hidden is Replicate(): its backward turns the Partial gradient into
    # hidden's own placements (all-reduce, or reduce-scatter for sequence-parallel tokens).
    h_local = hidden.redistribute(mesh, replicate).to_local(grad_placements=grad_placements)
    n_rows = math.prod(hidden.shape[:-1])
    h = h_local.reshape(n_rows, hidden.shape[-1])
    w = weight.to_local()
    b = bias.to_local() if bias is not None else None
    plan = plan_loss(
        labels, batch_shape=hidden.shape[:-1], n_classes=vocab.n_classes, device=h.device, what="hidden",
        ignore_index=ignore_index, mask=mask, weights=weights, reduction=reduction,
        num_label_tokens=num_label_tokens, label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap,
        chunk_size=chunk_size, auto_chunk_bytes=auto_chunk_bytes, auto_chunk_rows=auto_chunk_rows,
        row_classes=max(vocab.size, 1),
    )
    opts, args = _slice_options(plan, vocab)
    detached_b = b.detach() if b is not None else None
    stats = vocab_ops.linear_slice_stats(h.detach(), w.detach(), detached_b, plan.labels, *args, plan.chunk_rows,
                                         compile_chunks)
    lse, target, total = combine_stats(stats, vocab, opts.label_smoothing > 0.0)
    rows = vocab_ops.linear_slice_rows(h, w, b, plan.labels, lse, target, total, *args, plan.chunk_rows,
                                       compile_chunks)
    return replicate_result(reduce_rows(rows, plan), mesh)
