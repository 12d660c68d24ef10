"""``enable_packing``, ``check_model`` and ``packing_status``: the public side of the packing table.

What is patched, for which releases, is the table in :mod:`.table`; what a family must have
document-aware is :mod:`.coverage`; the replacements are in :mod:`.mask_builders`,
:mod:`.guards`, :mod:`.aux_loss`, :mod:`.alibi` and :mod:`.document_mixers`.
"""

from __future__ import annotations

import logging
import sys
from typing import Optional, Sequence

import torch

from ..checkpoint_resume import RESUME_RECORDS, RESUME_WHAT
from ..context_parallel.trainer import (
    ACCELERATE_HOOKS_RECORD,
    ACCELERATE_HOOKS_WHAT,
    CONTEXT_PARALLEL_TRAINER_RECORDS,
    CONTEXT_PARALLEL_TRAINER_WHAT,
    accelerate_version,
    context_parallel_trainer_status,
)
from ..registry import PatchHandle, StatusRow, StatusTable, apply_records, is_applied, live_records, record_status
from ..targets import model_modules
from .aux_loss import AUX_LOSS_NAME
from .coverage import CAPABILITIES, refusals_for_model
from .table import BUILDERS, COVERED_FAMILIES, MASK_PATH_TARGETS, RECURRENT, is_packing_record, packing_records

__all__ = ["enable_packing", "packing_status", "check_model", "packing_enabled"]

logger = logging.getLogger(__name__)


def enable_packing(
    model: Optional[torch.nn.Module] = None, *, strict: bool = True, extra_modules: Sequence[str] = ()
) -> PatchHandle:
    """Make an indexed 2D attention mask mean "same document, causal, not padding".

    Applies every record whose version gate and probe pass; returns a handle (``handle.remove()``
    or ``with enable_packing(): ...``). Enabling twice is a no-op; patches stay until the last
    handle is removed. Raises ``PatchError`` when an admitted record does not fit the installed
    Transformers (``strict=False``: log it and go on without that record). With ``model``, also
    raises ``ValueError`` naming the module and the reason, before patching anything, if the model
    has a refused capability (ALiBi, a recurrent / convolutional / linear-attention mixer, masks
    built outside masking_utils), and (undoing the patches) if any of its model modules builds
    masks in a way the patches do not cover, see :func:`check_model`. Without ``model``, a refused
    family raises at forward time when an indexed mask or packed ``position_ids`` reach it.

    Masks: 2D int and whole-number float masks are read as document ids (0 = padding), bool
    masks pass through; packed ``position_ids`` split documents too. Shapes ``[batch, seq]``.

    With it, ``Trainer`` under Accelerate's ``ParallelismConfig(cp_size=N)`` shards packed batches
    over the context-parallel processes with every document kept apart (Transformers 5.19+; refused
    before, see :mod:`model_patches.context_parallel.trainer`).
    """
    if model is not None:
        _refuse_capabilities(model, assume_patched=True)
        own = [m for m in _model_modules(model) if any(n in vars(sys.modules[m]) for n in (*BUILDERS, AUX_LOSS_NAME, RECURRENT))]
        extra_modules = [*extra_modules, *own]
    handle = apply_records(packing_records(extra_modules), strict=strict, what="packing")
    handle.companions.append(apply_records(RESUME_RECORDS, strict=False, what=RESUME_WHAT))
    # Trainer under ParallelismConfig(cp_size=N): packed batches sharded with documents kept apart
    handle.companions.append(apply_records(CONTEXT_PARALLEL_TRAINER_RECORDS, strict=False,
                                           what=CONTEXT_PARALLEL_TRAINER_WHAT))
    accelerate = accelerate_version()
    if accelerate is not None:
        handle.companions.append(apply_records((ACCELERATE_HOOKS_RECORD,), strict=False, version=accelerate,
                                               what=ACCELERATE_HOOKS_WHAT))
    applied = sum(r.state == "applied" for r in handle.rows)
    logger.info("packing patches: %d applied, %d rows", applied, len(handle.rows))
    if model is not None:
        try:
            check_model(model)
        except ValueError:
            handle.remove()
            raise
    return handle


def packing_enabled() -> bool:
    """Whether this process holds, through live handles, every packing record an indexed mask needs
    (:data:`.table.MASK_PATH_TARGETS`: the uncovered-module guard, ``masking_utils``' builders and
    flash's ``cu_seqlens``). :class:`~model_patches.PackingCollator` refuses to build batches
    without them."""
    live = {r.target for r in live_records() if is_packing_record(r)}
    return all(t in live for t in MASK_PATH_TARGETS)


def _model_modules(model: torch.nn.Module) -> list[str]:
    """The imported Transformers model modules that define some module of ``model``."""
    return sorted({type(m).__module__ for m in model.modules()} & set(model_modules()))


def check_model(model: torch.nn.Module) -> None:
    """Raise ``ValueError`` unless every Transformers model module used by ``model`` is covered now.

    Covered = every capability that mixes information along the sequence outside the attention
    masks (ALiBi, recurrent / convolutional / linear-attention mixers: see
    :mod:`model_patches.packing.coverage`) is absent or made correct by live records, and each
    module's ``create_causal_mask`` (and sliding-window builder, if it has one) is currently the
    packing replacement. A module without builders is covered only when it holds live
    made-correct records of the model's family (Mamba: no attention, every mixer per document).
    A module that builds masks another way would let packed documents attend to each other
    silently, so it is refused here.
    """
    _refuse_capabilities(model)
    modules = _model_modules(model)
    bad, covered = [], []
    made_correct = _made_correct_modules(model)
    for name in modules:
        namespace = vars(sys.modules[name])
        builders = [namespace[n] for n in BUILDERS if n in namespace]
        if builders:
            live = all(callable(getattr(b, "_packing_live", None)) and b._packing_live() for b in builders)
            (covered if live else bad).append(name)
        elif name in made_correct:  # no attention masks at all: Mamba's mixers
            covered.append(name)
    if not covered:  # a model with no masking_utils builders at all builds masks its own way
        bad = bad or modules or [type(model).__module__]
    if bad:
        raise ValueError(
            f"packing is not supported for {type(model).__name__}: {', '.join(bad)} "
            "does not build its attention masks with masking_utils.create_causal_mask / "
            "create_sliding_window_causal_mask under the packing patches, so an indexed mask "
            "would leak across documents. Fix: use a model family that does (covered by name: "
            f"{', '.join(COVERED_FAMILIES)}), or train this model without packing"
        )


def _made_correct_modules(model: torch.nn.Module) -> set[str]:
    """Modules holding live made-correct targets of ``model``'s families (every target patched)."""
    configs = [m.config for m in model.modules() if hasattr(m, "config")]
    return {
        target.partition(":")[0]
        for cap in CAPABILITIES for config in configs if cap.applies_to(config) and cap.covers(config)
        for target in cap.targets_for(config.model_type)
    }


def _refuse_capabilities(model: torch.nn.Module, assume_patched: bool = False) -> None:
    """Raise ValueError naming every refused capability of ``model`` (module and reason);
    ``assume_patched``: before applying, so families the records make correct pass."""
    refusals = refusals_for_model(model, assume_patched)
    if refusals:
        why = "; ".join(f"{cap.name} ({where}): {cap.reason}" for cap, where in refusals)
        raise ValueError(
            f"packing is refused for {type(model).__name__} ({', '.join(_model_modules(model)) or type(model).__module__}): "
            f"{why}. An indexed mask or packed position_ids would leak across documents. Fix: train "
            "this model with one document per row (a 0/1 or bool padding mask), or use a covered "
            "family (model_patches.packing_status())"
        )


def packing_status(extra_modules: Sequence[str] = ()) -> StatusTable:
    """One row per record: name, target, versions, state (applied/available/skipped/failed/refused), reason.

    Lists every packing record that is live however it was applied (plain ``enable_packing()``,
    ``model=``, ``extra_modules``, or a module discovered at the time) and the context-parallel
    Trainer records that come with it, then one ``refused`` row
    per capability of :data:`model_patches.packing.coverage.CAPABILITIES` with families it still
    refuses (or checks), and why, preceded by a ``made correct`` row listing the families where packing
    makes that capability document-aware (``applied`` while packing is on and every imported
    family's records are live, ``available`` otherwise).
    """
    records = packing_records(extra_modules)
    known = {r.target for r in records}
    records += [r for r in live_records() if r.target not in known and is_packing_record(r)]
    rows = record_status(records)
    rows += context_parallel_trainer_status()
    for cap in CAPABILITIES:
        made = [family for family, _ in cap.made_correct]
        if made:
            imported = [t for _, targets in cap.made_correct for t in targets if _module_imported(t)]
            live = bool(imported) and all(is_applied(t) for t in imported)
            rows.append(StatusRow(
                name=f"capability {cap.name} (made correct)", target=", ".join(made), versions="any",
                state="applied" if live else "available", epoch="capability",
                reason="document-aware once enable_packing() patches the family's records (rows above)",
            ))
        remaining = [f for f in cap.families if f not in made]
        if remaining:
            rows.append(StatusRow(
                name=f"capability {cap.name} ({cap.handling})", target=", ".join(remaining),
                versions="any", state="refused" if cap.handling == "refused" else "checked",
                reason=cap.reason, epoch="capability",
            ))
    return rows


def _module_imported(target: str) -> bool:
    return target.partition(":")[0] in sys.modules
