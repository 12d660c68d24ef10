"""Attention of a context-parallel process: its queries against every process's keys and values,
under the whole row's document mask.

Each process holds a head-tail shard of the packed row (:mod:`.layout`). Per attention layer:

1. keys and values are all-gathered over the group (rank-major order; backward sums their
   gradients over the group and keeps this process's tokens);
2. every process's ``position_ids`` and document ids are gathered too (no gradient): the shard
   carries them (:meth:`~.enable.ContextParallelHandle.shard`; Transformers hands a forward's
   keyword arguments down to attention, and checkpointing's recompute gets them again);
3. the local queries attend to the gathered keys under ``[local queries, keys]``: same document and
   key position <= query position. Never ``[T, T]``.

Step 3 runs the model's own sdpa or eager attention function with that mask, so GQA, scaling and
dropout are Transformers'. The attention functions are registered with Transformers under
``cp_sdpa``, ``cp_eager``, ``cp_flex_attention`` and ``cp_flash_attention_2/3``
(:data:`IMPLEMENTATIONS`; flex builds a ``BlockMask`` of the same mask instead, FlashAttention a
varlen sequence per piece of a document against its keys up to it); which group a model's layers use is looked
up from their config (:func:`register_group`), so a copy of the model that was not enabled raises
instead of attending alone.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

import torch
import torch.distributed as dist

__all__ = ["DOCUMENTS_KEY", "IMPLEMENTATIONS", "CPGroup", "gather_sequence", "gather_tokens", "register_group",
           "unregister_group"]

#: The keyword argument that carries each local token's document id from the model's call to its
#: attention layers (Transformers passes a forward's extra keyword arguments down to attention).
DOCUMENTS_KEY = "cp_document_ids"
#: The Transformers attention implementation each wrapped one is registered as.
IMPLEMENTATIONS = {"sdpa": "cp_sdpa", "eager": "cp_eager", "flex_attention": "cp_flex_attention",
                   "flash_attention_2": "cp_flash_attention_2", "flash_attention_3": "cp_flash_attention_3"}


@dataclasses.dataclass(frozen=True)
class CPGroup:
    """A context-parallel process group: ``group`` (None: the default group), its size and this
    process's rank in it."""

    group: Optional[dist.ProcessGroup]
    world: int
    rank: int
    #: The most ``rows x heads x queries x keys`` scores one sdpa call may hold (a kernel without
    #: fused masking keeps them): a longer shard attends in blocks of queries, each block a
    #: checkpoint region (see :func:`_attend`).
    mask_elements: int = 1 << 26
    #: A stand-in for tracing one process's step without a process group (memory estimates): every
    #: process holds this one's tokens, so a gather repeats them here.
    simulated: bool = False


#: id(config) -> its model's group, while a handle of :func:`~.enable.enable_context_parallel` is live
_GROUPS: dict[int, CPGroup] = {}


def register_group(config: Any, group: CPGroup) -> None:
    _GROUPS[id(config)] = group


def unregister_group(config: Any) -> None:
    _GROUPS.pop(id(config), None)


def _group_of(module: torch.nn.Module) -> CPGroup:
    config = getattr(module, "config", None)
    group = _GROUPS.get(id(config))
    if group is None:
        raise RuntimeError(
            f"{type(module).__name__} runs context-parallel attention ({getattr(config, '_attn_implementation', '?')}) "
            "but its model has no live context-parallel handle: a copy of an enabled model, or one whose handle was "
            "removed. Call model_patches.enable_context_parallel(model, group) on this model")
    return group


class _GatherSequence(torch.autograd.Function):
    """All-gather ``x`` along ``dim`` over the group, rank-major; backward: the gradient summed over
    the group, this process's slice (an all-reduce and a slice, which every backend has, gloo
    included; a reduce-scatter would move half the bytes)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cp: CPGroup, dim: int) -> torch.Tensor:
        ctx.cp, ctx.dim, ctx.local = cp, dim, x.shape[dim]
        return gather_tokens(x, cp, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], None, None]:
        cp, dim, n = ctx.cp, ctx.dim, ctx.local
        grad = grad.contiguous()
        dist.all_reduce(grad, group=cp.group)
        return grad.narrow(dim, cp.rank * n, n).contiguous(), None, None


def gather_sequence(x: torch.Tensor, cp: CPGroup, dim: int) -> torch.Tensor:
    """Every process's ``x`` along ``dim``, rank-major, differentiable (see :class:`_GatherSequence`)."""
    if cp.world == 1:
        return x
    if cp.simulated:
        return torch.cat([x] * cp.world, dim=dim)
    return _GatherSequence.apply(x, cp, dim)


def gather_tokens(t: torch.Tensor, cp: CPGroup, dim: int = 1) -> torch.Tensor:
    """Every process's ``t`` along ``dim``, rank-major, without a gradient."""
    if cp.world == 1:
        return t
    if cp.simulated:
        return torch.cat([t] * cp.world, dim=dim)
    parts = [torch.empty_like(t) for _ in range(cp.world)]
    dist.all_gather(parts, t.contiguous(), group=cp.group)
    return torch.cat(parts, dim=dim)


def document_mask(position_ids: torch.Tensor, documents: torch.Tensor, cp: CPGroup,
                  window: Optional[int] = None) -> torch.Tensor:
    """``[B, 1, local queries, keys]`` bool: the key is in the query's document and not after it
    (by position in the document), and with ``window`` fewer than ``window`` positions before it
    (Transformers' ``sliding_window_overlay``: ``kv > q - window``; inside one document the packed
    row's distance is the positions' distance); keys in the rank-major order
    :func:`gather_sequence` gives."""
    return _block_mask(position_ids, documents, gather_tokens(position_ids, cp), gather_tokens(documents, cp), window)


def _block_mask(positions: torch.Tensor, documents: torch.Tensor, key_positions: torch.Tensor,
                key_documents: torch.Tensor, window: Optional[int]) -> torch.Tensor:
    """:func:`document_mask` of the queries ``[B, Q]`` against gathered keys ``[B, T]``."""
    same = documents[:, :, None] == key_documents[:, None, :]
    distance = positions[:, :, None] - key_positions[:, None, :]
    allowed = same & (distance >= 0)
    if window:
        allowed &= distance < window
    return allowed[:, None]


#: The fewest queries a block holds, however long the row: past ``mask_elements / (heads x 128)``
#: keys a block's scores pass ``mask_elements`` rather than the step running thousands of calls a layer.
MIN_BLOCK = 128


def _sdpa_block(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                positions: torch.Tensor, documents: torch.Tensor, key_positions: torch.Tensor,
                key_documents: torch.Tensor, window: Optional[int], kwargs: dict[str, Any]) -> torch.Tensor:
    """Transformers' sdpa for one block of queries ``[B, H, Q, D]`` against every key: ``[B, Q, H, D]``."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    mask = _block_mask(positions, documents, key_positions, key_documents, window)
    return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, mask, is_causal=False, **kwargs)[0]


def _family_eager(module: torch.nn.Module) -> Any:
    """The eager attention function of the module's own modeling file (Gemma's soft-capping and the
    like live there), else Llama's."""
    import sys

    own = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if own is not None:
        return own
    from transformers.models.llama.modeling_llama import eager_attention_forward

    return eager_attention_forward


def _attend(inner: str, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
            attention_mask: Optional[torch.Tensor], **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """Local queries ``[B, H, L, D]`` against every process's keys and values under the row's
    document mask; Transformers' return, ``([B, L, H, D], weights or None)``. With sdpa, when
    ``B x H x L x T`` passes the group's ``mask_elements``, the queries attend in blocks of
    ``mask_elements // (B x H x T)`` (at least :data:`MIN_BLOCK`), each recomputed in backward: the
    mask and scores held at once are one block's."""
    cp = _group_of(module)
    position_ids = kwargs.pop("position_ids", None)
    documents = kwargs.pop(DOCUMENTS_KEY, None)
    if cp.simulated and (position_ids is None or documents is None):  # a traced step's plain ids: one document a row
        position_ids = torch.arange(query.shape[2], device=query.device)[None]
        documents = torch.ones_like(position_ids)
    if position_ids is None or documents is None:
        raise ValueError(f"context-parallel attention needs the shard's position_ids and {DOCUMENTS_KEY}: pass "
                         "the inputs cp.shard(batch) returns (model(**cp.shard(batch))); a model whose attention "
                         "does not receive the forward's keyword arguments cannot run context-parallel")
    # the layer's window: the keyword its module passes (None on full-attention layers), else its own
    window = kwargs["sliding_window"] if "sliding_window" in kwargs else getattr(module, "sliding_window", None)
    rows = query.shape[0]
    positions, documents = position_ids.expand(rows, -1), documents.expand(rows, -1)
    key_positions, key_documents = gather_tokens(positions, cp), gather_tokens(documents, cp)
    key = gather_sequence(key, cp, dim=2)
    value = gather_sequence(value, cp, dim=2)
    if inner == "flex":
        return _flex(module, query, key, value, positions, documents, key_positions, key_documents, window, kwargs)
    if inner.startswith("flash"):
        return _flash(inner, module, query, key, value, positions, documents, key_positions, key_documents, kwargs)
    if inner == "eager":
        mask = _block_mask(positions, documents, key_positions, key_documents, window)
        mask = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill(
            ~mask, torch.finfo(query.dtype).min)
        return _family_eager(module)(module, query, key, value, mask, **kwargs)
    kwargs.pop("is_causal", None)
    block = max(MIN_BLOCK, cp.mask_elements // (key.shape[2] * rows * query.shape[1]))
    if query.shape[2] <= block:
        return _sdpa_block(module, query, key, value, positions, documents, key_positions, key_documents, window,
                           kwargs), None
    # blocks of queries, each a checkpoint region: backward keeps the blocks' queries and the shared
    # keys and values, never a [local, T] mask or score tensor, and rebuilds one block's at a time
    from torch.utils.checkpoint import checkpoint

    starts = range(0, query.shape[2], block) if not cp.simulated else range(1)
    out = [checkpoint(_sdpa_block, module, query[:, :, s:s + block], key, value, positions[:, s:s + block],
                      documents[:, s:s + block], key_positions, key_documents, window, kwargs, use_reentrant=False)
           for s in starts]
    if cp.simulated:
        # a traced estimate: every block holds the same bytes at its turn, so the first is traced and
        # the others' output is a stand-in of its shape and storage ([B, rest, heads, value dim])
        rest = query[:, :, block:, :1].transpose(1, 2).expand(-1, -1, -1, value.shape[-1])
        out.append(rest.contiguous())
    return torch.cat(out, dim=1), None


def _flex(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
          positions: torch.Tensor, documents: torch.Tensor, key_positions: torch.Tensor, key_documents: torch.Tensor,
          window: Optional[int], kwargs: dict[str, Any]) -> tuple[torch.Tensor, Any]:
    """Transformers' flex attention under a ``BlockMask`` of the local queries against every key:
    the document mask as a ``mask_mod`` over this process's ids and the gathered ones (blocks with
    no allowed pair are skipped, and no ``[local, T]`` tensor is kept)."""
    from torch.nn.attention.flex_attention import create_block_mask
    from transformers.integrations.flex_attention import flex_attention_forward

    def same_document_causal(b: Any, h: Any, q: Any, kv: Any) -> Any:
        distance = positions[b, q] - key_positions[b, kv]
        allowed = (documents[b, q] == key_documents[b, kv]) & (distance >= 0)
        return allowed & (distance < window) if window else allowed

    block_mask = create_block_mask(same_document_causal, query.shape[0], None, query.shape[2], key.shape[2],
                                   device=query.device)
    kwargs.pop("is_causal", None)
    return flex_attention_forward(module, query, key, value, block_mask, **kwargs)


def _flash(inner: str, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           positions: torch.Tensor, documents: torch.Tensor, key_positions: torch.Tensor,
           key_documents: torch.Tensor, kwargs: dict[str, Any]) -> tuple[torch.Tensor, Any]:
    """Transformers' FlashAttention, varlen: each run of local queries (one document's consecutive
    positions: a piece of it, or a padding token) is a sequence whose keys are its document's from
    the document's first position to the run's last, in position order, so flash's bottom-right
    causal alignment (and its window) is the document mask. The keys of the pieces are gathered
    into one packed row (each document's prefix once per piece: at most twice the row's keys)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    rows, local = positions.shape
    tokens = key_positions.shape[1]
    device = query.device
    starts = torch.ones_like(positions, dtype=torch.bool)
    starts[:, 1:] = (documents[:, 1:] != documents[:, :-1]) | (positions[:, 1:] != positions[:, :-1] + 1)
    flat = starts.reshape(-1)
    run = flat.long().cumsum(0) - 1
    runs = int(run[-1]) + 1
    q_lens = torch.bincount(run, minlength=runs)
    last = torch.zeros(runs, dtype=positions.dtype, device=device).scatter_reduce(
        0, run, positions.reshape(-1), "amax", include_self=False)
    run_row = torch.arange(rows, device=device).repeat_interleave(local)[flat]
    run_doc = documents.reshape(-1)[flat]
    # every key of the rows ordered by (row, document, position): a document's keys are contiguous
    key_rows = torch.arange(rows, device=device)[:, None].expand(rows, tokens).reshape(-1)
    k_docs, k_pos = key_documents.reshape(-1), key_positions.reshape(-1)
    low = torch.minimum(k_docs.min(), run_doc.min())
    span = int(torch.maximum(k_docs.max(), run_doc.max()) - low) + 1
    order = torch.argsort(key_rows * span * (tokens + 1) + (k_docs - low) * (tokens + 1) + k_pos, stable=True)
    sorted_doc_key = (key_rows * span + (k_docs - low))[order]
    first = torch.searchsorted(sorted_doc_key, run_row * span + (run_doc - low))
    k_lens = last - k_pos[order][first] + 1
    offsets = torch.cumsum(k_lens, 0) - k_lens
    total = int(k_lens.sum())
    index = order[torch.repeat_interleave(first - offsets, k_lens) + torch.arange(total, device=device)]

    def packed(t: torch.Tensor) -> torch.Tensor:  # [B, heads, T, D] -> [1, heads, selected, D]
        flat_t = t.transpose(1, 2).reshape(rows * tokens, t.shape[1], t.shape[3])
        return flat_t.index_select(0, index).transpose(0, 1).unsqueeze(0)

    zero = torch.zeros(1, dtype=torch.int32, device=device)
    kwargs.update(is_causal=True, cu_seq_lens_q=torch.cat([zero, q_lens.cumsum(0).int()]),
                  cu_seq_lens_k=torch.cat([zero, k_lens.cumsum(0).int()]), max_length_q=int(q_lens.max()),
                  max_length_k=int(k_lens.max()))
    return ALL_ATTENTION_FUNCTIONS[inner](module, query, packed(key), packed(value), None, **kwargs)


def cp_flex_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: Optional[torch.Tensor], **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """Transformers' flex attention over the group's keys, under the row's document mask."""
    return _attend("flex", module, query, key, value, attention_mask, **kwargs)


def cp_sdpa_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: Optional[torch.Tensor], **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """Transformers' sdpa attention over the group's keys, under the row's document mask."""
    return _attend("sdpa", module, query, key, value, attention_mask, **kwargs)


def cp_eager_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: Optional[torch.Tensor], **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """Transformers' eager attention over the group's keys, under the row's document mask."""
    return _attend("eager", module, query, key, value, attention_mask, **kwargs)


def _no_mask(*args: Any, **kwargs: Any) -> None:
    """The mask Transformers would build from a shard is not the row's: attention builds its own."""
    return None


def register_implementations() -> None:
    """Register :data:`IMPLEMENTATIONS`' functions with Transformers' attention (and mask) interfaces."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    for fn, name in ((cp_sdpa_attention, "cp_sdpa"), (cp_eager_attention, "cp_eager"),
                     (cp_flex_attention, "cp_flex_attention")):
        AttentionInterface.register(name, fn)
        AttentionMaskInterface.register(name, _no_mask)
    for inner in ("flash_attention_2", "flash_attention_3"):
        AttentionInterface.register(IMPLEMENTATIONS[inner], functools.partial(_attend, inner))
        AttentionMaskInterface.register(IMPLEMENTATIONS[inner], _no_mask)
