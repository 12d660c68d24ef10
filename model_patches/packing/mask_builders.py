"""The mask builders of the packing records: the replacements a packed forward runs through.

Two replacements. The builders read every 2D integer or floating mask as document ids (a 0/1
padding mask is one document per row plus padding, so nothing needs to look at the values
first: no host sync, no graph break under ``torch.compile``); bool masks, 4D masks and ``None``
pass through to Transformers unchanged:

- ``create_causal_mask`` / ``create_sliding_window_causal_mask`` (in ``masking_utils`` and in
  every covered model module, which import them by name): for eager, sdpa and flex_attention
  the indexed mask is turned into document ids and handed to Transformers as an
  ``and_mask_function`` (kv not padding; a real query only within its document, a padding
  query as in Transformers' own padding mask), with the 2D mask set to ``None``, so
  Transformers builds its own causal / sliding-window mask in the backend's format: a float
  additive mask for eager, a bool mask for sdpa, a ``BlockMask`` for flex (flex never gets a
  4D tensor). For flash_attention_* the document-id tensor itself is returned as the layer mask.
- A batch without documents (at most one document per row: a 0/1 padding mask, pads anywhere) must
  be stock's bit for bit. On eager the mask above is already stock's, element for element
  (no value read). The builders of sdpa, flex_attention and flash_attention_* read the 2D
  mask's values themselves outside tracing (sdpa and flash drop an all-ones mask for the
  kernels' ``is_causal``, flex skips the padding function), which an ``and_mask_function``
  would switch off; there, and only outside tracing, the replacement reads one flag ("does any
  row hold a second document?") and, when none does, hands Transformers the caller's mask as
  bool, its own cast, so it takes its own path. Under ``torch.compile`` (or any tracing) it
  reads nothing and builds the mask above, as stock builds its mask there.
- ``modeling_flash_attention_utils._get_unpad_data``: a document-id mask yields one varlen
  sequence per document (per-document ``cu_seqlens``); a 0/1 mask keeps the original.
- the guards (refusals of what cannot be made document-aware) live in :mod:`.guards`.

Each wrapper stays live only while its target still points at it, so a module that imported
a wrapper while packing was on falls back to the original after the handle is removed.
"""

from __future__ import annotations

import functools
import importlib
import logging
from typing import Any, Callable, Optional

import torch
from torch._subclasses.fake_tensor import FakeTensor

from ..arguments import argument, mask_arguments, with_arguments
from ..targets import is_live, mask_arguments_probe, parameters, unwrapped
from .coverage import capabilities_for_config
from .guards import check_positions, refuse_packed_input
from .masks import (
    document_ids,
    is_indexed_mask,
    reads_as_document_ids,
    same_document_mask_function,
    split_at_position_resets,
    unpad_documents,
)

__all__ = [
    "CACHE_CAPACITY",
    "cache_capacity_probe",
    "mask_builder_probe",
    "build_mask_builder",
    "same_function_probe",
    "unpad_probe",
    "build_unpad",
]

logger = logging.getLogger(__name__)

_MASKING = "transformers.masking_utils"
_FLEX_OR_DENSE = ("eager", "sdpa", "flex_attention")


def mask_builder_probe(cache_arg: str, needs_cache_position: bool) -> Callable[[Any], Optional[str]]:
    """Probe: the mask builder takes (config, inputs_embeds, attention_mask, ...) with ``cache_arg``
    and ``and_mask_function``, and ``cache_position`` exactly when this epoch had it."""

    def probe(fn: Any) -> Optional[str]:
        shape = mask_arguments_probe(fn)
        if shape:
            return shape
        params = parameters(fn)
        for name in (cache_arg, "and_mask_function"):
            if name not in params:
                return f"no {name!r} parameter (found {params})"
        if cache_arg == "past_key_values" and "cache" in params:
            return f"'past_key_values' was renamed 'cache' (the 5.24+ signature; found {params})"
        if ("cache_position" in params) != needs_cache_position:
            return f"'cache_position' {'missing' if needs_cache_position else 'present'} (found {params})"
        return None

    probe.__name__ = f"mask_builder_probe[{cache_arg}]"
    return probe


def same_function_probe(name: str, cache_arg: str, needs_cache_position: bool) -> Callable[[Any], Optional[str]]:
    """Probe for a model module's imported ``name``: it must be ``masking_utils.<name>`` itself (or a
    wrapper of this package around it that the module imported while a packing handle was live)."""
    base = mask_builder_probe(cache_arg, needs_cache_position)

    def probe(fn: Any) -> Optional[str]:
        reference = unwrapped(getattr(importlib.import_module(_MASKING), name))
        fn = unwrapped(fn)
        if fn is not reference:
            return f"{name} is not masking_utils.{name}: this model module builds its masks another way"
        return base(fn)

    probe.__name__ = f"same_function_probe[{name}]"
    return probe


def build_mask_builder(target: str, cache_arg: str) -> Callable[[Any], Any]:
    """Builder of the ``create_*causal_mask`` replacement for ``target`` (see module docstring)."""

    def build(original: Callable) -> Callable:
        original = unwrapped(original)  # a stale wrapper, imported by a model module while a handle was live
        params = parameters(original)
        has_positions = "position_ids" in params

        @functools.wraps(original)
        def packed_mask(*args: Any, **kwargs: Any) -> Any:
            if not is_live(target, packed_mask):
                return original(*args, **kwargs)
            mask, config, embeds = mask_arguments(args, kwargs, params)
            positions = argument(args, kwargs, params, "position_ids") if has_positions else None
            positions = positions if isinstance(positions, torch.Tensor) and positions.ndim == 2 else None
            cache = argument(args, kwargs, params, cache_arg, "past_key_values", "cache")
            caps = capabilities_for_config(config)
            refused = [c for c in caps if c.handling == "refused" and not c.covers(config)]
            if refused:
                refuse_packed_input(mask, positions, embeds, target, config, refused)
                return original(*args, **kwargs)
            impl = getattr(config, "_attn_implementation", None) or "eager"
            if not reads_as_document_ids(mask):
                if mask is None and positions is not None and (_empty_cache(cache) or ("flash" in impl and cache is None)):
                    # Packed position_ids with a (fresh) cache: stock skips its packed-sequence
                    # detection whenever a cache exists and lets documents attend to each other;
                    # on flash it reads them at batch size 1 only.
                    ids = split_at_position_resets(
                        torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device), positions
                    )
                    if _without_documents(impl, ids) or ("flash" in impl and ids.shape[0] == 1):
                        return original(*args, **kwargs)
                    if "flash" in impl:  # the document ids are flash's layer mask (per-document cu_seqlens)
                        return ids
                    return _same_document_call(original, args, kwargs, params, ids, cache)
                return original(*args, **kwargs)
            ids = document_ids(mask)
            if positions is not None and positions.shape[-1] == ids.shape[1]:
                ids = split_at_position_resets(ids, positions.to(ids.device))
            if any(c.handling == "per_document_positions" for c in caps):
                check_positions(ids, positions, target, config)
            if _without_documents(impl, ids):
                # Transformers' own cast of a 2D mask (any non-zero value is a real token)
                args, kwargs = with_arguments(args, kwargs, params, attention_mask=mask != 0)
                return original(*args, **kwargs)
            if "flash" in impl:
                past = int(cache.get_seq_length()) if hasattr(cache, "get_seq_length") else 0
                if past or ids.shape[1] != embeds.shape[1]:
                    raise ValueError(
                        f"packed (indexed) attention masks under {impl} are supported for full "
                        f"sequences only, got {embeds.shape[1]} new tokens after {past} cached ones "
                        f"and a mask of length {ids.shape[1]}; decode with a bool mask or use sdpa"
                    )
                return ids.to(embeds.device)
            if impl not in _FLEX_OR_DENSE:
                raise ValueError(
                    f"packed (indexed) attention masks are supported on eager, sdpa, flex_attention "
                    f"and flash_attention_*, got attn_implementation={impl!r}; switch the model to "
                    "one of those"
                )
            if impl in ("sdpa", "eager"):
                _say_mask_bytes(impl, embeds)
            return _same_document_call(original, args, kwargs, params, ids.to(mask.device), cache)

        packed_mask._packing_original = original  # type: ignore[attr-defined]
        packed_mask._packing_live = lambda: is_live(target, packed_mask)  # type: ignore[attr-defined]
        return packed_mask

    return build


#: A dense packed mask at least this large is reported once per process (it is O(tokens^2)).
LARGE_MASK_BYTES = 256 * 2**20
_mask_reported = False


def _say_mask_bytes(impl: str, embeds: torch.Tensor) -> None:
    """Log once per process when sdpa or eager gets a dense ``[B, 1, T, T]`` packed mask of at least
    :data:`LARGE_MASK_BYTES`, with the backends that take the documents instead."""
    global _mask_reported
    batch, tokens = int(embeds.shape[0]), int(embeds.shape[1])
    size = batch * tokens * tokens * (1 if impl == "sdpa" else embeds.element_size())
    if _mask_reported or size < LARGE_MASK_BYTES:
        return
    _mask_reported = True
    logger.warning(
        "packing: %s needs a dense [%d, 1, %d, %d] document mask per mask call (%.0f MiB, growing with the square "
        "of the tokens); flex_attention (block masks) and flash_attention_2/3 (per-document cu_seqlens) take the "
        "documents without it", impl, batch, tokens, tokens, size / 2**20)


def _same_document_call(
    original: Callable, args: tuple, kwargs: dict, params: list[str], ids: torch.Tensor, cache: Any
) -> Any:
    """Call the stock builder with no 2D mask and "same document" ANDed into its mask function.

    Transformers then builds its own causal / sliding-window mask in the backend's format (a
    float additive mask for eager, bool for sdpa, a ``BlockMask`` for flex).
    """
    same_doc = same_document_mask_function(ids, _max_cache_length(cache))
    extra = argument(args, kwargs, params, "and_mask_function")
    if extra is not None:
        inner = same_doc

        def same_doc(b, h, q, kv):  # noqa: F811 - the caller's function AND ours
            return inner(b, h, q, kv) & extra(b, h, q, kv)

    replace: dict[str, Any] = {"attention_mask": None, "and_mask_function": same_doc}
    # position_ids only feed Transformers' own packed-sequence detection, which would remap
    # every mask function's indices to positions (ours expects token indices): drop them.
    if "position_ids" in params:
        replace["position_ids"] = None
    args, kwargs = with_arguments(args, kwargs, params, **replace)
    return original(*args, **kwargs)


#: Backends whose stock mask builder reads the 2D mask's values outside tracing (see the module
#: docstring); eager's does not, and gets stock's mask from the document-id path as it is.
_STOCK_READS_VALUES = ("sdpa", "flex_attention", "flash_attention")


def _without_documents(impl: str, ids: torch.Tensor) -> bool:
    """Whether to hand this call to the stock builder: ``impl`` is a backend whose stock builder
    reads the mask's values itself, nothing is being traced, and no row of ``ids`` holds a second
    document (one host read, on backends where stock reads the mask too)."""
    if not impl.startswith(_STOCK_READS_VALUES) or _tracing(ids):
        return False
    return not bool((ids > 1).any())


def _tracing(tensor: torch.Tensor) -> bool:
    """Values cannot be read now: dynamo (compile, export), jit or fx tracing, fake or meta
    tensors, CUDA graph capture."""
    if torch.compiler.is_compiling() or torch.jit.is_tracing() or not isinstance(tensor, torch.Tensor):
        return True
    if isinstance(tensor, FakeTensor) or tensor.device.type == "meta":
        return True
    return tensor.device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _empty_cache(cache: Any) -> bool:
    """A cache object holding no tokens yet (prefill); False for None or an unknown length.

    Hybrid caches report a linear-attention layer's count as a 0-dim tensor: read in eager mode
    (one scalar); under ``torch.compile`` it counts as unknown (the recurrent mask builder then
    refuses packed ``position_ids`` that lack an indexed mask, so nothing leaks silently).
    """
    if cache is None or not hasattr(cache, "get_seq_length"):
        return False
    length = cache.get_seq_length()
    if isinstance(length, torch.Tensor) and length.numel() == 1 and not torch.compiler.is_compiling():
        length = int(length)
    return isinstance(length, int) and length == 0


#: How each supported release names a cache's capacity (the most any layer holds; -1 or None:
#: unbounded): ``get_max_length`` in recent releases, ``get_max_cache_shape`` in older ones.
CACHE_CAPACITY = ("get_max_length", "get_max_cache_shape")


def cache_capacity_probe(cache_class: Any) -> Optional[str]:
    """Probe: the cache class answers one of :data:`CACHE_CAPACITY` (what a static cache's masks
    are sized by; without it, indexed masks could not be padded to a static cache's length)."""
    if any(callable(getattr(cache_class, name, None)) for name in CACHE_CAPACITY):
        return None
    return f"{getattr(cache_class, '__name__', cache_class)} has none of {list(CACHE_CAPACITY)}"


def _max_cache_length(cache: Any) -> Optional[int]:
    """A cache's capacity when bounded (a static cache's masks are that long, longer than the 2D
    mask), else None; read through :data:`CACHE_CAPACITY`, the name this release uses."""
    for name in CACHE_CAPACITY:
        get = getattr(cache, name, None)
        if not callable(get):
            continue
        if name == "get_max_cache_shape":  # per layer (layer 0 by default): the largest of them
            layers = len(getattr(cache, "layers", ())) or 1
            values = [get(i) for i in range(layers)]
        else:  # the largest over layers by default
            values = [get()]
        bounded = [int(v) for v in values if isinstance(v, int) and v > 0]
        return max(bounded) if bounded else None
    return None


def unpad_probe(fn: Any) -> Optional[str]:
    """``_get_unpad_data(mask)`` must return (indices, cu_seqlens [B+1], max_seqlen) for a 0/1 mask."""
    if parameters(fn)[:1] != ["attention_mask"]:
        return f"expected a single 'attention_mask' parameter, found {parameters(fn)}"
    try:
        out = fn(torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.int32))
    except Exception as exc:  # noqa: BLE001 - report any failure as a probe failure
        return f"calling it on a 0/1 mask raised {type(exc).__name__}: {exc}"
    if not (isinstance(out, tuple) and len(out) == 3):
        return f"expected a 3-tuple (indices, cu_seqlens, max_seqlen), got {type(out).__name__}"
    indices, cu, max_len = out
    if cu.tolist() != [0, 2, 5] or indices.tolist() != [0, 1, 3, 4, 5] or int(max_len) != 3:
        return f"unexpected result on [[1,1,0],[1,1,1]]: cu_seqlens={cu.tolist()}, indices={indices.tolist()}"
    return None


def build_unpad(original: Callable) -> Callable:
    """``_get_unpad_data`` that gives every document of an indexed mask its own sequence."""

    @functools.wraps(original)
    def get_unpad_data(attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        if is_indexed_mask(attention_mask):
            return unpad_documents(attention_mask)
        return original(attention_mask)

    get_unpad_data._packing_original = original  # type: ignore[attr-defined]
    return get_unpad_data

