"""``enable_context_parallel(model, group)``: packed documents with the sequence sharded over a
process group, every document still alone, the loss the one process's.

A hand-written loop::

    cp = model_patches.enable_context_parallel(model, mesh["cp"].get_group())
    inputs = cp.shard(batch)                  # the packed global batch -> this process's shard
    loss = model(**inputs).loss               # this process's share of the global mean
    loss.backward()
    for p in model.parameters():              # the gradients sum over the group (or let FSDP2/DDP
        dist.all_reduce(p.grad, group=cp.group)  #  reduce over it; see ContextParallelHandle.shard)

Attention: :mod:`.attention` (keys and values gathered, ``[local queries, keys]`` document mask,
Transformers' sdpa or eager). Layout: :mod:`.layout` (every document cut head-tail over the group,
documents from ``position_ids`` or an indexed mask).
"""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from .attention import (
    DOCUMENTS_KEY,
    IMPLEMENTATIONS,
    CPGroup,
    gather_tokens,
    register_group,
    register_implementations,
    unregister_group,
)
from .layout import DocumentLayout, document_ids
from .router_loss import forward_hooks

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["ContextParallelHandle", "enable_context_parallel", "shard_batch", "simulate_context_parallel"]

logger = logging.getLogger(__name__)
IGNORE_INDEX = -100
#: The MoE load-balancing loss function of a Transformers model module (the packing patch's
#: ``model_patches.packing.aux_loss`` replaces it, and computes it over the whole sequence here).
_ROUTER_LOSS = "load_balancing_loss_func"


def _configs(model: nn.Module) -> list[Any]:
    """Every config object the model's modules read ``_attn_implementation`` from."""
    seen: dict[int, Any] = {}
    for m in model.modules():
        config = getattr(m, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            seen.setdefault(id(config), config)
    return list(seen.values())


def _capability_refusal(model: nn.Module) -> Optional[str]:
    """The packing capability ``model`` has that no shard can keep (ALiBi, a stateful mixer whose
    state would have to cross processes, masks built outside Transformers' mask functions), or None.
    Families whose mixers packing makes document-aware are refused here too: their state runs
    along the whole row."""
    from ..packing.coverage import CAPABILITIES, detected_in

    configs = {id(m.config): m.config for m in model.modules() if hasattr(m, "config")}
    for cap in CAPABILITIES:
        if cap.handling != "refused":
            continue
        hit = next((f"model_type {c.model_type!r}" for c in configs.values() if cap.applies_to(c)), None)
        if hit is None:
            where = detected_in(model, cap)
            hit = None if where is None else f"module {where!r}"
        if hit is not None:
            return f"{cap.name} ({hit}): {cap.reason}; train this model without context parallelism"
    return None


def _refusal(model: nn.Module) -> Optional[str]:
    """Why ``model`` cannot run context-parallel, or None."""
    why = _capability_refusal(model)
    if why is not None:
        return why
    for config in _configs(model):
        impl = config._attn_implementation
        if impl in IMPLEMENTATIONS.values():
            return (f"context-parallel attention ({impl}) already: remove the first handle before enabling it "
                    "again")
        if impl not in IMPLEMENTATIONS:
            return (f"attention implementation {impl!r}: context parallelism with packed documents runs on "
                    f"{sorted(IMPLEMENTATIONS)} here; load the model with attn_implementation='sdpa'")
        if getattr(config, "attention_chunk_size", None):
            return (f"chunked attention (attention_chunk_size={config.attention_chunk_size}): chunks are not kept "
                    "under context parallelism; train this model without it")
        kinds = set(getattr(config, "layer_types", None) or ()) - {"full_attention", "sliding_attention"}
        if kinds:
            return (f"layer types {sorted(kinds)}: chunked and stateful (linear-attention, SSM) layers are not kept "
                    "correct under context parallelism (sliding windows and full attention are); train this model "
                    "without it")
    return None


class ContextParallelHandle:
    """What :func:`enable_context_parallel` returns: :meth:`shard`, :meth:`unshard`, :meth:`remove`
    (also a context manager). ``group``: the process group; ``world``, ``rank``: its size and
    this process's rank in it."""

    def __init__(self, model: nn.Module, cp: CPGroup, previous: dict[int, str], configs: list[Any],
                 hooks: list[Any]) -> None:
        self.model, self._cp, self._previous, self._configs, self._hooks = model, cp, previous, configs, hooks
        self._last: Optional[DocumentLayout] = None
        self.removed = False

    @property
    def group(self) -> Optional[dist.ProcessGroup]:
        return self._cp.group

    @property
    def world(self) -> int:
        return self._cp.world

    @property
    def rank(self) -> int:
        return self._cp.rank

    def shard(self, batch: Mapping[str, Any], num_items_in_batch: Optional[int] = None) -> dict[str, Any]:
        """This process's inputs from a packed global batch.

        Args:
            batch: ``input_ids`` ``[B, T]``, and optionally ``labels`` ``[B, T]`` (``-100`` ignored),
                ``position_ids`` ``[B, T]`` (each document counts from 0) or ``attention_mask``
                ``[B, T]`` as document ids (``PackingCollator``'s: 1, 2, ... per document, 0
                padding); with neither, each row is one document; ``shift_labels`` ``[B, T]`` (the
                labels already shifted by one) in place of ``labels``. The same batch on every
                process of the group.
            num_items_in_batch: the labels the loss is averaged over, when the step spans more than
                this batch (data-parallel replicas, gradient accumulation): their total count.
                Default: this batch's labels.

        Returns:
            ``input_ids``, ``position_ids`` and ``cp_document_ids`` of this process's tokens (``[B,
            L]``: pieces ``rank`` and ``2 * world - 1 - rank`` of every document, padded to the
            longest process's), and, with labels, ``labels`` and ``shift_labels`` (the labels shifted
            by one over the whole row before sharding, so the token before a piece boundary still
            predicts the one after it) and ``num_items_in_batch``. ``model(**inputs).loss`` is then
            this process's sum of token losses over the global label count: the losses over the
            group sum to the one process's mean, and so do the gradients. All-reduce (sum) the
            gradients over the group; an engine that averages over the group instead (FSDP2 or DDP
            over a mesh that includes it) gives the one process's gradients divided by the group
            size, so multiply the loss by ``world`` there. No gradient is scaled by the group size
            otherwise.
        """
        out, self._last = shard_batch(batch, self.world, self.rank, num_items_in_batch)
        return out

    def unshard(self, t: torch.Tensor) -> torch.Tensor:
        """A per-token local output of the last :meth:`shard`'s inputs (logits, per-token losses:
        ``[B, L, ...]``) in the whole batch's order ``[B, T, ...]``, on every process (padding
        dropped)."""
        if self._last is None:
            raise RuntimeError("unshard puts back the tokens of the last shard(batch): call shard first")
        return self._last.unshard(gather_tokens(t, self._cp))

    def remove(self) -> None:
        """Put the model's attention implementation back and forget its group."""
        if self.removed:
            return
        for hook in self._hooks:
            hook.remove()
        for config in self._configs:
            config._attn_implementation = self._previous[id(config)]
            unregister_group(config)
        self.removed = True

    def __enter__(self) -> "ContextParallelHandle":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    def __repr__(self) -> str:
        return f"<ContextParallelHandle world={self.world} rank={self.rank}{' removed' if self.removed else ''}>"


def shard_batch(batch: Mapping[str, Any], world: int, rank: int,
                num_items_in_batch: Optional[int] = None) -> tuple[dict[str, Any], DocumentLayout]:
    """Process ``rank``'s inputs of ``world`` from a packed global batch, and the layout that cut it
    (what :meth:`ContextParallelHandle.shard` returns; see there). ``shift_labels`` in ``batch``
    (labels already shifted by one, as padding-free collators give them) are used as they are."""
    ids = batch["input_ids"]
    if ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, tokens], got shape {tuple(ids.shape)}")
    positions, documents, padding = _positions_and_documents(batch, ids)
    layout = DocumentLayout.of(documents, world)
    width = layout.local_tokens
    pads = (layout.index[rank].to(ids.device) < 0) | layout.shard(padding, rank, fill=1).bool()
    # padding (the layout's and the batch's own): its own document (negative, unique over the
    # group), so that it attends to itself only and no MoE load-balancing loss counts it
    own = -(1 + rank * width + torch.arange(width, device=ids.device)).expand_as(pads)
    out: dict[str, Any] = {
        "input_ids": layout.shard(ids, rank, fill=0),
        "position_ids": layout.shard(positions, rank, fill=0),
        DOCUMENTS_KEY: torch.where(pads, own, layout.shard(documents, rank, fill=0)),
    }
    shifted = batch.get("shift_labels")
    labels = batch.get("labels")
    if shifted is None and labels is not None:
        shifted = torch.full_like(labels, IGNORE_INDEX)
        shifted[:, :-1] = labels[:, 1:]
    if shifted is not None:
        local = layout.shard(shifted, rank, fill=IGNORE_INDEX)
        count = int((shifted != IGNORE_INDEX).sum()) if num_items_in_batch is None else int(num_items_in_batch)
        out.update(labels=local, shift_labels=local, num_items_in_batch=torch.tensor(max(count, 1)))
    return out, layout


def _positions_and_documents(batch: Mapping[str, Any],
                             ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``position_ids``, document ids and padding (1 where padding, long) ``[B, T]`` of the packed
    rows: from ``position_ids``, else from an indexed ``attention_mask`` (positions counted within
    its documents; padding, 0, its own document per token), else one document per row."""
    index = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    positions = batch.get("position_ids")
    none = torch.zeros_like(ids)
    if positions is not None:
        positions = positions.expand_as(ids)
        return positions, document_ids(positions), none
    mask = batch.get("attention_mask")
    if mask is None:
        return index, torch.ones_like(ids), none
    docs = mask.long()
    start = torch.ones_like(docs, dtype=torch.bool)
    start[:, 1:] = docs[:, 1:] != docs[:, :-1]
    start |= docs == 0
    first = torch.where(start, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - first, start.long().cumsum(dim=1), (docs == 0).long()


def _router_loss_check(model: nn.Module, configs: list[Any]) -> Callable[[dict[str, Any]], None]:
    """``check(forward kwargs)``: raises when the forward asks for router logits (the MoE
    load-balancing loss) and a model module's loss function is not the packing patch's, which
    counts it over the whole sequence."""
    from ..registry import is_applied

    modules = sorted({type(m).__module__ for m in model.modules()})
    targets = [f"{name}:{_ROUTER_LOSS}" for name in modules
               if name in sys.modules and callable(vars(sys.modules[name]).get(_ROUTER_LOSS))]

    def check(kwargs: dict[str, Any]) -> None:
        wanted = kwargs.get("output_router_logits")
        if wanted is None:
            wanted = any(getattr(c, "output_router_logits", False) for c in configs)
        missing = [t for t in targets if not is_applied(t)] if wanted else []
        if missing:
            raise ValueError(
                f"enable_context_parallel: {type(model).__name__} computes the MoE load-balancing loss "
                f"(output_router_logits=True) with {missing[0]} unpatched, so each process would count only its "
                "own tokens: call model_patches.enable_packing(model) before the forward (its patch counts the "
                "whole sequence), or set output_router_logits=False")

    return check


#: Default of ``mask_elements``: 64M scores per attention block (256 MiB in fp32).
MASK_ELEMENTS = 1 << 26


def enable_context_parallel(model: nn.Module, group: Union[dist.ProcessGroup, "DeviceMesh", None] = None, *,
                            mask_elements: Optional[int] = None) -> ContextParallelHandle:
    """Run ``model``'s attention context-parallel over ``group`` (a process group, a 1-D device
    mesh such as ``mesh["cp"]``, or None: the default group), packed documents kept apart.

    Each process holds a head-tail piece of every packed document (:meth:`ContextParallelHandle.shard`);
    each attention layer all-gathers keys and values over the group and attends its local queries
    to them under the whole row's document mask (same document, causal), ``[local, T]`` per row.
    Runs on the sdpa, eager, flex_attention and flash_attention_2/3 implementations (flex through a
    ``BlockMask``, forward tested on CPU, where flex has no backward; FlashAttention varlen, each
    piece of a document against its document's keys up to it, tested through the CPU double of
    its kernels). MoE models route each token where it is; their
    load-balancing loss (``output_router_logits``) is counted over the whole sequence, with
    :func:`~model_patches.enable_packing` on (:mod:`.router_loss`). Refused, with the setting to
    change: other attention implementations (paged, hub kernels), chunked layers, stateful mixers,
    the load-balancing
    loss without the packing patch. Sliding-window layers apply their window to positions in the
    whole row.

    Memory: each process holds its shard's activations, the gathered keys and values of the layer
    that runs, and its ``[local, T]`` mask. With sdpa, where the scores ``B x heads x local x T``
    pass ``mask_elements`` (default :data:`MASK_ELEMENTS`), the local queries attend in blocks,
    each a checkpoint region: no mask or score tensor longer than a block's is kept for backward, at
    the cost of running the attention forward again per block in backward (eager keeps its
    ``[B, heads, local, T]`` weights by definition).

    Returns:
        A :class:`ContextParallelHandle` (``remove()`` or ``with``).
    """
    configs, check = _checked(model, "enable_context_parallel")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("enable_context_parallel needs an initialised process group "
                           "(torch.distributed.init_process_group)")
    if hasattr(group, "get_group") and hasattr(group, "mesh_dim_names"):  # a DeviceMesh
        if group.ndim != 1:
            raise ValueError(f"enable_context_parallel takes a 1-D device mesh (the context-parallel dimension, "
                             f"mesh['cp']), got {group.ndim} dimensions {group.mesh_dim_names}")
        group = group.get_group()
    cp = CPGroup(group, dist.get_world_size(group), dist.get_rank(group), mask_elements=_mask_elements(mask_elements))
    return _enable(model, cp, configs, check)


def _checked(model: nn.Module, who: str) -> tuple[list[Any], Callable[[dict[str, Any]], None]]:
    """``model``'s configs and its forward check (:func:`_router_loss_check`), after raising what
    context parallelism refuses for it."""
    why = _refusal(model)
    if why is not None:
        raise ValueError(f"{who}: {type(model).__name__} has {why}")
    configs = _configs(model)
    check = _router_loss_check(model, configs)
    check({})
    return configs, check


def _mask_elements(value: Optional[int]) -> int:
    value = MASK_ELEMENTS if value is None else value
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"mask_elements must be a positive int (scores per attention block), got {value!r}")
    return value


def simulate_context_parallel(model: nn.Module, world: int, *,
                              mask_elements: Optional[int] = None) -> ContextParallelHandle:
    """``model``'s context-parallel attention as process 0 of ``world`` would run it, without a
    process group: each gather repeats this process's keys, values and ids ``world`` times, so a
    traced step (``ac_policies.estimate(..., context_parallel=world)``) holds what a real process
    holds. Not for training: the "other processes'" tokens are copies of these. Refuses what
    :func:`enable_context_parallel` refuses; ``mask_elements`` as there."""
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"world must be a positive int (processes the sequence is sharded over), got {world!r}")
    configs, check = _checked(model, "simulate_context_parallel")
    cp = CPGroup(None, world, 0, mask_elements=_mask_elements(mask_elements), simulated=True)
    return _enable(model, cp, configs, check)


def _enable(model: nn.Module, cp: CPGroup, configs: list[Any],
            check: Callable[[dict[str, Any]], None]) -> ContextParallelHandle:
    register_implementations()
    previous = {}
    for config in configs:
        previous[id(config)] = config._attn_implementation
        config._attn_implementation = IMPLEMENTATIONS.get(config._attn_implementation, config._attn_implementation)
        register_group(config, cp)
    logger.info("context parallel over %d processes (rank %d): %s", cp.world, cp.rank,
                sorted({c._attn_implementation for c in configs}))
    hooks = forward_hooks(model, cp, DOCUMENTS_KEY, check)
    return ContextParallelHandle(model, cp, previous, configs, hooks)

