"""Guards of the packing records: they refuse what the patches cannot make document-aware.

- ``masking_utils._preprocess_mask_arguments``: an indexed mask that still reaches it came from
  a model module the builders do not cover, which would silently cast it to bool.
- ``create_recurrent_attention_mask`` (releases that have it): Mamba / linear-attention / conv
  layers would scale tokens by their document id and carry state across documents; families
  whose mixers run per document get the document ids instead (:func:`build_recurrent_mask`).
- ``*ForCausalLM.forward`` of families whose masks never pass through masking_utils: refused
  ones refuse indexed masks and packed ``position_ids`` (which they ignore or misread); made
  correct ones (Mamba) refuse only packed ``position_ids`` the mask does not separate.
- the builders' own checks: families with a refused capability (ALiBi, stateful mixers), and
  absolute position embeddings fed row positions (see :mod:`model_patches.packing.coverage`).

Checks that need data are ``ValueError``s on CPU eager and ``torch._assert_async`` on an
accelerator or under ``torch.compile`` (a ``RuntimeError`` with the same message): no host sync,
no graph break.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Callable, Optional

import torch

from ..arguments import argument, mask_arguments
from ..targets import is_live, parameters, parameters_probe
from .coverage import capabilities_for_config
from .masks import document_ids, document_positions, reads_as_document_ids, split_at_position_resets

__all__ = [
    "refuse_if",
    "refuse_indexed",
    "refuse_packed_input",
    "position_restarts",
    "check_positions",
    "build_guard",
    "build_recurrent_mask",
    "forward_probe",
    "build_forward_guard",
]


def refuse_if(flag: torch.Tensor, message: str) -> None:
    """Raise ``message`` where the bool scalar ``flag`` is True.

    CPU eager: ``ValueError`` after reading the flag (free there). Accelerator or compiling:
    ``torch._assert_async`` (no host sync, no graph break), a ``RuntimeError`` with ``message``.
    """
    if flag.device.type == "cpu" and not torch.compiler.is_compiling():
        if bool(flag):
            raise ValueError(message)
        return
    torch._assert_async(~flag, message)


def refuse_indexed(mask: torch.Tensor, message: str) -> None:
    """Raise ``message`` unless ``mask`` (2D, read as ids) holds at most one document per row
    (every value <= 1), see :func:`refuse_if`."""
    if mask.numel():
        refuse_if((mask > 1).any(), message)


def _family(target: str, config: Any) -> str:
    module = target.partition(":")[0]
    kind = getattr(config, "model_type", "?")
    return module if ".models." in module else f"model_type {kind!r}"


def position_restarts(positions: Any, mask: Any) -> Optional[torch.Tensor]:
    """Bool scalar: ``positions`` ([B, T], [T] or [3, B, T], int) restart inside a run of real
    tokens the mask puts in one document, i.e. they mark packed documents the mask does not.
    None when there is nothing to read (no positions, T <= 1). ``mask`` ([B, T], any dtype,
    optional): restarts next to padding (0; left padding's positions restart too) and where the
    mask's document id changes (an indexed mask, whose documents restart) are allowed."""
    if not isinstance(positions, torch.Tensor) or positions.ndim == 0 or positions.shape[-1] <= 1:
        return None
    restarts = positions[..., 1:] != positions[..., :-1] + 1
    if isinstance(mask, torch.Tensor) and mask.ndim == 2 and mask.shape[-1] == positions.shape[-1]:
        restarts = restarts & (mask[:, 1:] != 0) & (mask[:, 1:] == mask[:, :-1])
    return restarts.any()


def refuse_packed_input(mask: Any, positions: Optional[torch.Tensor], embeds: Any, target: str,
                         config: Any, refused: list) -> None:
    """Raise if an indexed mask, or packed position_ids, reach a family packing refuses."""
    why = "; ".join(f"{c.name}: {c.reason}" for c in refused)
    message = (
        f"packing is refused for {_family(target, config)} ({why}). An indexed (packed) mask or "
        "packed position_ids would leak across documents there. Fix: train this model without "
        "packing (one document per row, a 0/1 or bool padding mask), or use a covered family "
        "(model_patches.packing_status())"
    )
    flags = []
    if reads_as_document_ids(mask) and mask.numel():
        flags.append((mask > 1).any())
    if embeds is not None and positions is not None and embeds.shape[1] == positions.shape[-1]:
        restart = position_restarts(positions, mask)
        if restart is not None:
            flags.append(restart)
    if flags:
        flag = flags[0] if len(flags) == 1 else flags[0] | flags[1].to(flags[0].device)
        refuse_if(flag, message)


def check_positions(ids: torch.Tensor, positions: Optional[torch.Tensor], target: str, config: Any) -> None:
    """Absolute position embeddings: every document after a row's first must start at position 0."""
    message = (
        f"{_family(target, config)} uses absolute position embeddings, and it got an indexed "
        "(packed) mask with row positions: documents after the first would be embedded at the "
        "wrong positions. Fix: pass per-document position_ids (PackingCollator returns them)"
    )
    if positions is None or positions.shape[-1] != ids.shape[1]:
        refuse_indexed(ids, message.replace(
            "it got an indexed (packed) mask with row positions",
            "its mask builder gets no position_ids to check against the documents of an indexed (packed) mask",
        ))
        return
    expected = document_positions(ids)
    refuse_if(((ids > 1) & (positions.to(ids.device) != expected)).any(), message)


def build_recurrent_mask(target: str) -> Callable[[Any], Any]:
    """Builder of ``create_recurrent_attention_mask`` under packing.

    Transformers hands that 2D mask to Mamba / linear-attention / convolution layers, which
    multiply hidden states by it and carry their state across it. For a family whose mixers run
    per document (its ``stateful_mixer`` records live, see
    :mod:`model_patches.packing.document_mixers`), the replacement returns the document ids instead:
    from an int / float mask, split further at packed ``position_ids``; from a bool mask or no
    mask, when ``position_ids`` are packed (checked with one host read in eager mode; under
    ``torch.compile`` packed ``position_ids`` without an indexed mask are refused instead, so
    that ordinary batches compile as stock). For any other family an indexed mask is refused:
    it would scale tokens by their document id and leak state between documents.
    """

    def build(original: Callable) -> Callable:
        params = parameters(original)

        @functools.wraps(original)
        def recurrent_mask(*args: Any, **kwargs: Any) -> Any:
            if not is_live(target, recurrent_mask):
                return original(*args, **kwargs)
            mask, config, embeds = mask_arguments(args, kwargs, params)
            mixers = [c for c in capabilities_for_config(config) if c.handling == "refused"]
            if not mixers or any(not c.covers(config) for c in mixers):
                if reads_as_document_ids(mask):
                    refuse_indexed(mask, (
                        f"packing is refused for {_family(target, config)} (stateful_mixer: its "
                        "recurrent / convolutional / linear-attention layers carry state from one "
                        "document into the next whatever the attention mask says). Fix: train this "
                        "model without packing (one document per row, a 0/1 or bool padding mask)"
                    ))
                return original(*args, **kwargs)
            length = embeds.shape[1] if isinstance(embeds, torch.Tensor) else 0
            positions = kwargs.get("position_ids")
            if not (isinstance(positions, torch.Tensor) and positions.ndim == 2 and positions.shape[-1] == length):
                positions = None
            if length <= 1 or (mask is not None and not (isinstance(mask, torch.Tensor) and mask.ndim == 2)):
                return original(*args, **kwargs)
            if reads_as_document_ids(mask):
                ids = document_ids(mask)[:, -length:]
            else:
                if positions is None:
                    return original(*args, **kwargs)
                base = mask[:, -length:] if mask is not None else torch.ones(embeds.shape[:2], device=embeds.device)
                ids = base.long()
                restart = position_restarts(positions, ids)
                if torch.compiler.is_compiling() or ids.device.type != "cpu":
                    refuse_if(restart, (
                        f"{_family(target, config)}: packed position_ids without an indexed attention "
                        "mask reach a recurrent mixer inside a compiled region (or off the CPU), where "
                        "the documents cannot be told apart without a host read. Fix: pass the "
                        "collator's indexed attention_mask (PackingCollator returns it)"
                    ))
                    return original(*args, **kwargs)
                if not bool(restart):
                    return original(*args, **kwargs)
            if positions is not None:
                ids = split_at_position_resets(ids, positions.to(ids.device))
            return ids.contiguous()

        recurrent_mask._packing_original = original  # type: ignore[attr-defined]
        return recurrent_mask

    return build


def forward_probe(fn: Any) -> Optional[str]:
    """A model ``forward`` guarded by :func:`build_forward_guard` must take ``attention_mask``."""
    return parameters_probe(fn, required=("attention_mask",))


def build_forward_guard(family: str) -> Callable[[Any], Any]:
    """Builder of a model ``forward`` of a family whose masks never pass through masking_utils
    (Mamba, RWKV, models with their own masks).

    While the family has a refused capability (see :mod:`model_patches.packing.coverage`), it refuses
    an indexed mask and packed ``position_ids``. Once every capability is made correct (Mamba's
    mixers run per document), indexed masks pass, and only packed ``position_ids`` that the mask
    does not separate are refused: those mixers read documents from the mask alone.
    """

    def build(original: Callable) -> Callable:
        params = parameters(original)

        @functools.wraps(original)
        def forward(*args: Any, **kwargs: Any) -> Any:
            mask = argument(args, kwargs, params, "attention_mask")
            config = getattr(args[0], "config", None) if args else None
            refused = [c for c in capabilities_for_config(config) if c.handling == "refused" and not c.covers(config)]
            if config is None or refused:
                why = "; ".join(f"{c.name}: {c.reason}" for c in refused) or "no config to check"
                message = (
                    f"packing is refused for model_type {family!r} ({why}). An indexed (packed) "
                    "mask or packed position_ids would leak across documents. Fix: train this "
                    "model without packing (one document per row, a 0/1 or bool padding mask)"
                )
                if reads_as_document_ids(mask):
                    refuse_indexed(mask, message)
            else:
                message = (
                    f"model_type {family!r} reads packed documents from an indexed attention mask "
                    "only, and got packed position_ids (restarting inside what the mask calls one "
                    "document). Fix: pass the indexed mask of the packed batch (PackingCollator "
                    "returns it) instead of position-id packing"
                )
            restart = position_restarts(argument(args, kwargs, params, "position_ids"), mask)
            if restart is not None:  # position-id packing: the family ignores or misreads them
                refuse_if(restart, message)
            return original(*args, **kwargs)

        forward._packing_original = original  # type: ignore[attr-defined]
        return forward

    return build


def _calling_module(frame: Any) -> str:
    """The first module up the stack outside masking_utils and Transformers' decorators."""
    while frame is not None:
        name = frame.f_globals.get("__name__", "?")
        if not name.startswith(("transformers.masking_utils", "transformers.utils", "model_patches", "functools")):
            return name
        frame = frame.f_back
    return "?"


def build_guard(original: Callable) -> Callable:
    """``_preprocess_mask_arguments`` that refuses an indexed mask instead of casting it to bool."""

    params = parameters(original)

    @functools.wraps(original)
    def preprocess(*args: Any, **kwargs: Any) -> Any:
        mask = mask_arguments(args, kwargs, params)[0]
        if reads_as_document_ids(mask):
            where = "masking_utils"
            if not torch.compiler.is_compiling():
                caller = sys._getframe(1)
                where = f"masking_utils.{caller.f_code.co_name} from {_calling_module(caller)}"
            refuse_indexed(
                mask,
                f"an indexed (packed) attention mask reached {where}, which the packing patches do "
                "not cover; Transformers would cast it to bool and let packed documents attend to "
                "each other. Fix: use a covered model family (see model_patches.packing_status()), "
                "call enable_packing() again after importing this model's module, or pass a 0/1 "
                "mask without packing",
            )
        return original(*args, **kwargs)

    preprocess._packing_original = original  # type: ignore[attr-defined]
    return preprocess
