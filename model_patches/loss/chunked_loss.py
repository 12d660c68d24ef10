"""Registry record routing Transformers' causal-LM loss through ``functional_ce.cross_entropy``.

Transformers computes ``model(..., labels=...)``'s loss with ``ForCausalLMLoss`` (looked up in
``LOSS_MAPPING`` by ``PreTrainedModel.loss_function``), which first makes a full fp32 copy of the
logits, then runs ``F.cross_entropy`` on it (another fp32 ``[N, V]`` for the log-softmax and one
for its gradient). The replacement keeps the same contract (label shift by padding with
``ignore_index``, ``shift_labels`` for packed rows, ``num_items_in_batch`` normalisation, extra
keyword arguments ignored) and computes the loss from the logits in their own dtype, one fp32
chunk at a time.

The record replaces ``transformers.modeling_utils.LOSS_MAPPING`` (the name ``loss_function``
reads) with a view of the original mapping in which every entry that is ``ForCausalLMLoss``
(``ForCausalLM``, ``ForConditionalGeneration``, ...) is routed. ``loss_utils.LOSS_MAPPING``
itself is left alone, so the Trainer's ``LOSS_MAPPING[...] is ForCausalLMLoss`` check (which
decides how it counts ``num_items_in_batch``) still sees the original.

One deliberate difference: with no valid label in the batch, Transformers returns NaN (0 / 0);
the routed loss returns 0 with zero gradients.
"""

from __future__ import annotations

import collections
from typing import Any, Optional

import torch
import torch.nn.functional as F

import functional_ce
from patch_layer import track

from ..checkpoint_resume import RESUME_RECORDS, RESUME_WHAT
from ..registry import PatchHandle, PatchRecord, StatusTable, apply_records, record_status
from ..targets import parameters_probe
from .per_model_state import ReleaseWithModel
from .trl_heads import refuse_unrouted_trl_heads
from .unused_loss_watch import TRAINER_HEAD_FIX, LossUseWatch, loss_reached, trainer_fused_head

__all__ = ["LOSS_RECORDS", "chunked_causal_lm_loss", "enable_chunked_loss", "chunked_loss_status"]

_EXPECTED_PARAMS = ("logits", "labels", "vocab_size", "num_items_in_batch", "ignore_index", "shift_labels")


def chunked_causal_lm_loss(
    logits: torch.Tensor,
    labels: Optional[torch.Tensor],
    vocab_size: int,
    num_items_in_batch: Optional[Any] = None,
    ignore_index: int = -100,
    shift_labels: Optional[torch.Tensor] = None,
    **kwargs: Any,
) -> torch.Tensor:
    """Drop-in for Transformers' ``ForCausalLMLoss`` (4.50+) without the fp32 logits copy.

    Args:
        logits: ``[B, T, V]`` (or ``[..., V]``) in the model's dtype.
        labels: ``[B, T]`` unshifted labels; position ``t`` predicts ``labels[t + 1]``. Ignored
            when ``shift_labels`` is given.
        vocab_size: ``V``.
        num_items_in_batch: if given, the loss is the sum over valid tokens divided by it
            (gradient accumulation); otherwise the mean over valid tokens.
        ignore_index: label value without loss.
        shift_labels: ``[B, T]`` labels already aligned with ``logits`` (packed rows, sequence
            parallelism).
        **kwargs: ignored, as Transformers ignores them.

    Returns:
        fp32 scalar loss.
    """
    loss_reached()
    if shift_labels is None:
        if labels is None:
            raise ValueError("the causal-LM loss needs labels or shift_labels, got neither")
        labels = labels.to(logits.device)
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    logits2d = logits.reshape(-1, vocab_size)
    shift_labels = shift_labels.reshape(-1).to(logits.device)
    if num_items_in_batch is None:
        return functional_ce.cross_entropy(logits2d, shift_labels, ignore_index=ignore_index, reduction="mean")
    if isinstance(num_items_in_batch, torch.Tensor):
        num_items_in_batch = num_items_in_batch.to(logits.device)
    return functional_ce.cross_entropy(
        logits2d, shift_labels, ignore_index=ignore_index, reduction="sum", num_label_tokens=num_items_in_batch
    )


def _probe_loss_mapping(mapping: Any) -> Optional[str]:
    if not isinstance(mapping, collections.abc.Mapping):
        return f"expected a mapping of loss names to functions, got {type(mapping).__name__}"
    fn = mapping.get("ForCausalLM")
    if fn is None:
        return "it has no 'ForCausalLM' entry"
    if fn is chunked_causal_lm_loss:
        return None
    shape = parameters_probe(fn, first=_EXPECTED_PARAMS)
    return f"its ForCausalLM loss: {shape}" if shape else None


def _build_loss_mapping(mapping: collections.abc.Mapping) -> collections.abc.Mapping:
    original = mapping["ForCausalLM"]
    routed = {name: chunked_causal_lm_loss for name, fn in mapping.items() if fn is original}
    # A live view: losses registered in the original mapping later remain visible.
    return collections.ChainMap(routed, mapping)  # type: ignore[arg-type]


#: The Hugging Face loss-path records (one today; a list so the gate can split by epoch later).
LOSS_RECORDS: tuple[PatchRecord, ...] = (
    PatchRecord(
        name="LOSS_MAPPING['ForCausalLM'] -> functional_ce.cross_entropy",
        target="transformers.modeling_utils:LOSS_MAPPING",
        versions=">=4.50",
        probe=_probe_loss_mapping,
        build=_build_loss_mapping,
        epoch="4.50+",
        doc="ForCausalLMLoss with shift_labels (added in 4.50); older releases slice the logits instead.",
        table="loss",
    ),
)


def enable_chunked_loss(model: Optional[torch.nn.Module] = None, *, strict: bool = True) -> PatchHandle:
    """Route ``model(..., labels=...)``'s causal-LM loss through ``functional_ce.cross_entropy``.

    Returns the undo handle (also a context manager). Applying twice is a no-op. A model with its
    own ``loss_function`` attribute set, or a custom ``loss_type`` outside the mapping's
    ``ForCausalLMLoss`` entries, is not affected.

    Used or refused: TRL's trainers compute their loss in TRL's own fused LM head and chunked
    divergence, never through ``LOSS_MAPPING``, so while the handle is active those kernels refuse
    with the fix (:func:`model_patches.enable_trl_heads`, which routes them through
    ``functional_ce`` instead). Without ``model=`` the routing is process-wide, and so is the
    refusal: every TRL run in the process is refused until the handle is removed. With ``model=``
    the refusal concerns that model only: a trainer head already installed on it is refused now,
    one installed later at its first step, and a training call of it with labels that finishes
    without reaching the routed loss gets one ``UserWarning`` and a log record; other models train
    with TRL's own kernels. That handle holds the model weakly and removes itself when the model is
    garbage-collected. With TRL installed, enabling imports ``trl.trainer.utils`` (about 2 s the
    first time).

    Args:
        model: optional ``*ForCausalLM`` to check, watch and scope the refusal of TRL's kernels
            to (``LOSS_MAPPING``, which the routing replaces, stays process-wide while the handle
            is active).
        strict: a record that cannot be applied raises (default) instead of being logged.

    Raises:
        PatchError: with ``strict``, a record admitted by its version gate cannot be applied.
        ValueError: ``model`` carries a trainer's own fused LM head.
        TypeError: ``model`` is not a ``torch.nn.Module``.
    """
    if model is not None and not isinstance(model, torch.nn.Module):
        raise TypeError(f"enable_chunked_loss: model must be a torch.nn.Module or None, got {type(model).__name__}")
    head = trainer_fused_head(model) if model is not None else None
    if head is not None:
        raise ValueError(
            f"enable_chunked_loss: {head} is installed on {type(model).__name__} and computes its training loss "
            f"without Transformers' LOSS_MAPPING, so the chunked loss would never run. {TRAINER_HEAD_FIX}"
        )
    handle = apply_records(LOSS_RECORDS, strict=strict, what="chunked loss")
    handle.companions.append(apply_records(RESUME_RECORDS, strict=False, what=RESUME_WHAT))
    if model is None:
        handle.companions.append(refuse_unrouted_trl_heads(
            "enable_chunked_loss routes Transformers' LOSS_MAPPING for every model in this process, which TRL's "
            "fused LM head and chunked divergence never call: this step would run TRL's own kernel and leave the "
            f"chunked loss silently unused. {TRAINER_HEAD_FIX}; enable_chunked_loss(model=...) refuses only the "
            "runs of that model"
        ))
        return handle
    handle.companions.append(refuse_unrouted_trl_heads(
        f"enable_chunked_loss is active on {type(model).__name__}, but TRL's fused kernel is computing its loss "
        f"from hidden states, never through Transformers' LOSS_MAPPING, so the chunked loss is silently unused. "
        f"{TRAINER_HEAD_FIX}",
        model=model,
    ))
    handle.companions.append(LossUseWatch(model, "enable_chunked_loss", TRAINER_HEAD_FIX))
    handle.companions.append(ReleaseWithModel(model, handle))
    track(model, handle)
    return handle


def chunked_loss_status() -> StatusTable:
    """One row per loss record: applied / available / skipped / failed, and why."""
    return record_status(LOSS_RECORDS)
