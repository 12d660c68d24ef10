"""Key/value and recurrent-state caches passed through a checkpointed module.

A cache that this step created empty (Transformers builds one when ``use_cache`` is on, as it
is by default for Qwen3-Next) is written once by the real forward; the recompute in backward
runs with a throwaway copy of the cache whose layer is still empty, so it takes the same code
path (op for op, as selective checkpointing requires) without writing the real cache again. A cache whose layer already held tokens (or recurrent state) before the
step is refused: the recompute could not reproduce the cached prefix.

Every cache layer type Transformers ships is read by duck typing (no transformers import):
attention layers (``is_initialized`` / ``get_seq_length``, static or dynamic, sliding or full),
linear-attention layers (``cumulative_length_linear`` and ``has_previous_state`` for conv and
recurrent states, whose ``get_seq_length`` is a 0-d tensor), hybrids of both, and dummy layers.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Optional

import torch
from torch import nn

__all__ = ["is_cache", "has_cache", "layer_idx", "held_tokens", "cache_safe"]


def is_cache(obj: Any) -> bool:
    """A key/value (or recurrent-state) cache, by duck typing."""
    return (
        callable(getattr(obj, "update", None))
        and callable(getattr(obj, "get_seq_length", None))
        and not isinstance(obj, (dict, torch.Tensor))
    )


def has_cache(args: tuple, kwargs: dict) -> bool:
    return any(is_cache(a) for a in args) or any(is_cache(v) for v in kwargs.values())


def layer_idx(module: nn.Module) -> Optional[int]:
    """The ``layer_idx`` of the module or its first descendant that has one."""
    for m in module.modules():
        idx = getattr(m, "layer_idx", None)
        if isinstance(idx, int) and not isinstance(idx, bool):
            return idx
    return None


def _as_int(value: Any) -> Optional[int]:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
        return int(value.item())
    return None


def _layer_tokens(layer: Any) -> Optional[int]:
    """Tokens (or recurrent steps) one cache layer holds; None when it holds state of unknown length."""
    counts = [0]
    seq = getattr(layer, "get_seq_length", None)
    if callable(seq) and getattr(layer, "is_initialized", True) is not False:
        counts.append(_as_int(seq()))
    if hasattr(layer, "cumulative_length_linear"):
        counts.append(_as_int(layer.cumulative_length_linear))
    if None in counts:
        return None
    for flags in ("has_previous_state", "is_conv_states_initialized", "is_recurrent_states_initialized"):
        held = getattr(layer, flags, None)
        if isinstance(held, dict) and any(held.values()) and max(counts) == 0:
            return None  # conv/recurrent state written without a token count
    return max(counts)


def held_tokens(cache: Any, idx: Optional[int]) -> Optional[int]:
    """Tokens the cache holds for layer ``idx`` (0 when empty); None when it cannot tell.

    Without a layer index, 0 only when every layer is empty.
    """
    layers = getattr(cache, "layers", None)
    if isinstance(layers, (list, tuple)):
        if idx is None:
            per_layer = [_layer_tokens(layer) for layer in layers]
            return 0 if all(n == 0 for n in per_layer) else None
        if idx >= len(layers):
            return 0  # layers are appended as they are first written
        return _layer_tokens(layers[idx])
    if idx is None:
        return None
    try:
        return _as_int(cache.get_seq_length(idx))
    except Exception:  # noqa: BLE001 - foreign cache types; treated as "cannot tell"
        return None


def cache_safe(module: nn.Module, fqn: str, fn: Callable, args: tuple, kwargs: dict) -> Callable:
    """A forward for checkpoint that fills an empty cache once and recomputes without it.

    Raises ValueError under torch.compile (train with ``use_cache=False``) and when the cache
    already holds tokens for the module's layer.
    """
    if torch.compiler.is_compiling():
        raise ValueError(
            f"ac_policies: checkpointed module {fqn!r} received a KV cache under torch.compile; "
            "train with use_cache=False (or cache=None)"
        )
    idx = layer_idx(module)
    for c in [a for a in args if is_cache(a)] + [v for v in kwargs.values() if is_cache(v)]:
        n = held_tokens(c, idx)
        if n != 0:
            held = "an unknown number of" if n is None else str(n)
            raise ValueError(
                f"ac_policies: checkpointed module {fqn!r} ({type(module).__name__}) received a "
                f"{type(c).__name__} that already holds {held} token(s) for layer {idx} while training with "
                "gradients enabled; recomputing it in backward would not reproduce the cached state and would write "
                "the cache a second time. Train with use_cache=False (or cache=None), call model.eval() for cached "
                "decoding, or exclude this module with a rule whose action is 'none'."
            )
    # taken now, while the layer is still empty: the recompute writes into these instead
    stand_ins = {id(c): _stand_in(c, idx) for c in [*args, *kwargs.values()] if is_cache(c)}
    calls = [0]

    def forward_once_with_cache(*a: Any, **kw: Any) -> Any:
        calls[0] += 1
        if calls[0] > 1:  # recompute in backward: the cache already holds this step's entries
            a = tuple(stand_ins.get(id(x), x) if is_cache(x) else x for x in a)
            kw = {k: (stand_ins.get(id(v), v) if is_cache(v) else v) for k, v in kw.items()}
        return fn(*a, **kw)

    return forward_once_with_cache


def _stand_in(cache: Any, idx: Optional[int]) -> Any:
    """A throwaway cache whose layer ``idx`` is a copy of the (empty) layer now, or None.

    The recompute then takes the same code path as the real forward (an empty cache, not no
    cache), so op-level selective checkpointing sees the same op sequence; other layers are
    shared, unchanged. None (recompute without a cache) for caches without a ``layers`` list.
    """
    layers = getattr(cache, "layers", None)
    if not isinstance(layers, list):
        return None
    try:
        clone = copy.copy(cache)
        if idx is None:  # every layer is empty: copy them all
            clone.layers = copy.deepcopy(layers)
        else:
            clone.layers = list(layers[: idx + 1])
            if idx < len(layers):
                clone.layers[idx] = copy.deepcopy(layers[idx])
            clone.layers += layers[idx + 1 :]
        return clone
    except Exception:  # noqa: BLE001 - a cache that cannot be copied is recomputed without one
        return None
