"""The keywords a causal-LM forward takes, for a patch that runs the decoder instead of it.

:func:`model_patches.enable_linear_cross_entropy` replaces a model's ``forward``; in its loss path it
runs the decoder directly, so a keyword the model's own forward does not take belongs to code that
path would skip (a wrapper below the patch, a trainer's fused head) and is refused by name
(:func:`refuse_unknown_keywords`) rather than dropped.
"""

from __future__ import annotations

import inspect
import typing
from typing import Any, Optional

import torch.nn as nn

from .unused_loss_watch import FUSED_HEAD_KEYWORD

__all__ = ["LOSS_ONLY_KEYS", "as_keywords", "model_keywords", "refuse_unknown_keywords"]

#: Keywords of ``model(...)`` that only the loss reads (the decoder never gets them).
LOSS_ONLY_KEYS = ("labels", "shift_labels", "num_items_in_batch", "logits_to_keep", "ignore_index")
#: Keywords every causal-LM forward of Transformers takes or passes on, named or not.
STOCK_KEYWORDS = ("return_dict", "past_key_values", "cache", "output_attentions", "output_hidden_states")
#: Keys this library's own batches carry (``PackingCollator(return_num_tokens=True)``; the document
#: ids of a context-parallel shard, which the decoder hands down to attention).
LIBRARY_BATCH_KEYS = ("num_tokens", "cp_document_ids")


def model_keywords(model_class: type) -> Optional[frozenset[str]]:
    """The keywords ``model_class.forward`` names, plus the keys of its typed ``**kwargs``
    (``Unpack[TransformersKwargs]``) and the ones every causal-LM forward takes; None when its
    ``**kwargs`` is untyped (any keyword goes to the decoder, as the model's own forward does)."""
    try:
        params = inspect.signature(model_class.forward).parameters.values()
    except (TypeError, ValueError):
        return None
    names = {p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)} - {"self"}
    var_keyword = next((p for p in params if p.kind is p.VAR_KEYWORD), None)
    if var_keyword is not None:
        typed = typing.get_args(var_keyword.annotation)
        keys = getattr(typed[0], "__annotations__", None) if typed else None
        if not isinstance(keys, dict):
            return None
        names |= set(keys)
    return frozenset(names | set(LOSS_ONLY_KEYS) | set(STOCK_KEYWORDS) | set(LIBRARY_BATCH_KEYS))


def refuse_unknown_keywords(model: nn.Module, known: Optional[frozenset[str]], kwargs: dict[str, Any]) -> None:
    """Raise ``ValueError`` naming the keywords in ``kwargs`` outside ``known`` (None: any goes)."""
    unknown = sorted(k for k in kwargs if k not in known) if known is not None else []
    if not unknown:
        return
    owner = (
        f" ({FUSED_HEAD_KEYWORD!r} asks a trainer's fused LM head for its output; that head would compute the "
        "loss itself: use model_patches.enable_trl_heads() instead of this patch)"
        if FUSED_HEAD_KEYWORD in unknown else ""
    )
    raise ValueError(
        f"enable_linear_cross_entropy: {type(model).__name__}(...) got keyword(s) {unknown} that its forward does not "
        f"take{owner}. The hidden-state loss runs the decoder directly, so it would skip whatever code they are "
        "for. Remove them from the batch, or remove the patch (handle.remove()) if another wrapper needs them."
    )


def as_keywords(signature: inspect.Signature, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Positional inputs named as the model's forward (of ``signature``) names them."""
    bound = signature.bind_partial(*args, **kwargs)
    out: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        if signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
            out.update(value)
        else:
            out[name] = value
    return out
