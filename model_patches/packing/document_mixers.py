"""Stateful sequence mixers run per document: the mixer records of the packing patches.

A recurrent, convolutional or linear-attention mixer (Mamba / Mamba-2 SSMs, gated delta nets,
short convolutions) carries a state along the row, so in a packed row document 2 starts from
the state document 1 left behind, whatever the attention mask says. The replacement of a
mixer's ``forward`` runs each document as a segment of its own, from a fresh state, with the
family's own code:

1. the document ids come from the mask the mixer receives (the packing replacement of
   ``create_recurrent_attention_mask`` hands covered mixers the document ids instead of the
   raw mask) or, for one flattened row, from ``cu_seq_lens_q`` (flash-attention-style
   position-id packing, which the mixers' torch paths ignore);
2. when no row holds more than one document, the original forward runs as is, on the 0/1
   validity mask: ordinary padded batches keep stock behaviour;
3. otherwise documents are gathered into right-padded ``[documents, length]`` batches, grouped
   by length so that each group is at most twice its real tokens (lengths in ``(2^(k-1), 2^k]``
   share a group: at most ``log2(seq) + 1`` calls per layer), the original forward runs on each
   group with a 0/1 right-padding mask and no cache, and the outputs are scattered back into
   ``[batch, seq, ...]`` (0 on padding). A causal mixer's output at a token depends only on
   the tokens before it, so trailing padding changes nothing: each document gets what it gets
   alone.

Reading the layout costs one host synchronisation per forward (shared by every mixer layer).
Under ``torch.compile`` the layout is read outside the graph whenever a mixer gets an integer
mask (packed or padded), and dynamo splits every frame above that read (10 graphs / 9 breaks
for a 2-layer Qwen3-Next forward); the segment shapes recompile once when document lengths first
change, then run with dynamic shapes. Batches with no mask, or a bool mask, compile as stock.

Caches: a cache that already holds this layer's state cannot continue several documents at once
(refused). A fresh cache (a training forward with ``use_cache`` left on) is accepted: the
documents run without it, and the layer is marked in the cache, so that generating from that
cache later raises instead of decoding from a missing state.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from typing import Any, Callable, Optional

import torch

from ..arguments import argument, with_arguments
from ..targets import parameters, parameters_probe
from .masks import document_ids, reads_as_document_ids

__all__ = ["mixer_probe", "build_mixer", "SegmentLayout", "segment_layout", "document_ids_from_cu_seqlens"]

#: kwargs that describe the packed row's layout; a per-document segment must not see them.
_LAYOUT_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx", "position_ids")
_CACHE_NAMES = ("cache", "cache_params", "past_key_values")
#: attribute set on a cache whose mixer layers a packed forward ran without it
_STATELESS = "_packing_stateless_layers"


def mixer_probe(fn: Any) -> Optional[str]:
    """A mixer ``forward(self, hidden_states, ..., attention_mask, ...)`` with a cache parameter."""
    shape = parameters_probe(fn, first=("self", "hidden_states"), required=("attention_mask",))
    if shape:
        return shape
    if not any(name in parameters(fn) for name in _CACHE_NAMES):
        return f"no cache parameter ({' / '.join(_CACHE_NAMES)}; found {parameters(fn)})"
    return None


@dataclasses.dataclass(frozen=True)
class SegmentLayout:
    """Where every document of a ``[B, L]`` id tensor lies, grouped for per-document runs.

    ``groups``: one ``(index, valid)`` pair per length group: ``index`` int64 ``[D, M]`` flat
    token positions in ``[0, B * L]`` (``B * L`` = an all-zero padding slot), ``valid`` bool
    ``[D, M]`` (True on a document's tokens, a prefix of each row). ``one_per_row``: no row holds
    more than one document (the original forward is exact there).
    """

    groups: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    one_per_row: bool
    padded_tokens: int
    real_tokens: int


def segment_layout(ids: torch.Tensor) -> SegmentLayout:
    """Layout of the documents of ``ids`` (int ``[B, L]`` from :func:`document_ids`, 0 = padding;
    one host sync). A document is its row's real tokens with its id, consecutive among the row's
    real tokens (padding inside a document, as in a right-padded prompt under ``generate()``, is
    skipped: the run gathers the document's tokens)."""
    batch, length = ids.shape
    flat = ids.flatten()
    positions = torch.nonzero(flat != 0).flatten()  # the real tokens, in order
    key = (positions // length) * (length + 1) + flat[positions]  # (row, id): one per document
    _, lengths = torch.unique_consecutive(key, return_counts=True)
    first = torch.cumsum(lengths, 0) - lengths  # each document's first token, in `positions`
    first_list, length_list = first.tolist(), lengths.tolist()
    rows = (positions[first] // length).tolist()
    one_per_row = len(set(rows)) == len(rows)
    by_group: dict[int, list[int]] = {}
    for d, n in enumerate(length_list):
        by_group.setdefault(max(n - 1, 0).bit_length(), []).append(d)
    groups, padded = [], 0
    for key in sorted(by_group):
        docs = by_group[key]
        width = max(length_list[d] for d in docs)
        start = torch.tensor([first_list[d] for d in docs], device=ids.device)
        count = torch.tensor([length_list[d] for d in docs], device=ids.device)
        offset = torch.arange(width, device=ids.device)
        valid = offset[None, :] < count[:, None]
        taken = positions[torch.where(valid, start[:, None] + offset[None, :], torch.zeros_like(start)[:, None])]
        index = torch.where(valid, taken, torch.full_like(taken, batch * length))
        groups.append((index, valid))
        padded += len(docs) * width
    return SegmentLayout(tuple(groups), one_per_row, padded, sum(length_list))


def document_ids_from_cu_seqlens(cu_seqlens: torch.Tensor, length: int) -> torch.Tensor:
    """``cu_seqlens`` ``[D + 1]`` of one flattened row -> document ids int64 ``[1, length]``
    (1, 2, ...; 0 past ``cu_seqlens[-1]``)."""
    cu = cu_seqlens.to(torch.long)
    t = torch.arange(length, device=cu.device)
    ids = torch.searchsorted(cu[1:], t, right=True) + 1
    return torch.where(t < cu[-1], ids, torch.zeros_like(ids))[None, :]


#: (weakref to the mask tensor, its version, its layout): the mixers of one forward share one mask.
_LAST_LAYOUT: list[Any] = [None, -1, None]


@torch._dynamo.disable
def _layout_of(mask: torch.Tensor, ids: torch.Tensor) -> SegmentLayout:
    """The layout of ``ids``, computed once per mask tensor; runs outside ``torch.compile`` (one
    graph break per mixer layer instead of one per host read)."""
    ref, version, layout = _LAST_LAYOUT
    if ref is not None and ref() is mask and version == mask._version:
        return layout
    layout = segment_layout(ids)
    _LAST_LAYOUT[:] = [weakref.ref(mask), mask._version, layout]
    return layout


def _layer_holds_state(cache: Any, layer_idx: Any) -> bool:
    """Whether ``cache`` already holds state for mixer layer ``layer_idx`` (unknown -> True)."""
    try:
        return int(cache.get_seq_length(layer_idx)) > 0
    except Exception:  # noqa: BLE001 - a cache that cannot say is treated as holding state
        return True


def build_mixer(original: Callable) -> Callable:
    """Mixer ``forward`` that runs every document of a packed row from a fresh state (see module docstring)."""
    params = parameters(original)
    cache_name = next(name for name in _CACHE_NAMES if name in params)

    @functools.wraps(original)
    def forward(self: torch.nn.Module, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        call: tuple = (self, hidden_states, *args)
        mask, cache = argument(call, kwargs, params, "attention_mask"), argument(call, kwargs, params, cache_name)
        layer = getattr(self, "layer_idx", None)
        if cache is not None and layer in getattr(cache, _STATELESS, ()):
            raise ValueError(
                f"{type(self).__name__} (layer {layer}): this cache was filled by a packed forward, whose "
                "documents ran without it, so it holds no state to continue from. Generate from an "
                "unpacked batch (one document per row)"
            )
        length = hidden_states.shape[1]
        ids = document_ids(mask) if reads_as_document_ids(mask) and mask.shape[-1] == length else None
        cu = kwargs.get("cu_seq_lens_q")
        if isinstance(cu, torch.Tensor) and hidden_states.shape[0] == 1 and length > 1:
            from_cu = document_ids_from_cu_seqlens(cu, length)
            ids = from_cu if ids is None else document_ids(from_cu * (ids != 0))
        if ids is None:
            return original(*call, **kwargs)
        layout = _layout_of(mask if isinstance(mask, torch.Tensor) else ids, ids)
        for name in _LAYOUT_KWARGS:
            kwargs.pop(name, None)
        valid = (ids != 0).to(mask.dtype if isinstance(mask, torch.Tensor) and not mask.is_floating_point() else torch.long)
        if layout.one_per_row:
            call, kwargs = with_arguments(call, kwargs, params, attention_mask=valid)
            return original(*call, **kwargs)
        if cache is not None:
            if _layer_holds_state(cache, layer):
                raise ValueError(
                    f"{type(self).__name__} (layer {layer}): a packed row (several documents) cannot "
                    "continue from a cache that already holds state; decode one document per row"
                )
            try:
                setattr(cache, _STATELESS, getattr(cache, _STATELESS, frozenset()) | {layer})
            except AttributeError:
                pass
        call, kwargs = with_arguments(call, kwargs, params, **{cache_name: None})
        return _run_per_document(original, call, kwargs, params, hidden_states, layout, valid.dtype)

    forward._packing_original = original  # type: ignore[attr-defined]
    forward._packing_per_document = True  # type: ignore[attr-defined]
    return forward


def _run_per_document(original: Callable, call: tuple, kwargs: dict, params: list[str], hidden_states: torch.Tensor,
                      layout: SegmentLayout, mask_dtype: torch.dtype) -> torch.Tensor:
    """Run ``original`` once per length group and scatter the outputs back to ``[B, L, ...]``."""
    batch, length = hidden_states.shape[:2]
    tail = hidden_states.shape[2:]
    flat = torch.cat([hidden_states.reshape(batch * length, *tail), hidden_states.new_zeros(1, *tail)])
    out: Optional[torch.Tensor] = None
    for index, valid in layout.groups:
        group_args, group_kwargs = with_arguments(
            call, kwargs, params, hidden_states=flat[index], attention_mask=valid.to(mask_dtype)
        )
        result = original(*group_args, **group_kwargs)
        extra = 0
        if isinstance(result, tuple) and result and isinstance(result[0], torch.Tensor):
            result, extra = result[0], len(result) - 1  # (output, state / weights): see below
        if not isinstance(result, torch.Tensor):
            raise TypeError(
                f"{type(call[0]).__name__}.forward returned {type(result).__name__}; the per-document "
                "mixer record expects a [batch, seq, ...] tensor or a tuple starting with one"
            )
        if out is None:
            out = result.new_zeros(batch * length + 1, *result.shape[2:])
        # every slot is written, padding into the discarded last row: no data-dependent shapes
        out = out.index_copy(0, index.flatten(), result.flatten(0, 1))
    assert out is not None  # a layout always has a group when some row holds two documents
    out = out[: batch * length].reshape(batch, length, *out.shape[1:])
    # A per-document run has no row-wide final state or attention weights: those slots are None.
    return (out, *([None] * extra)) if extra else out
