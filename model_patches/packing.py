"""Sequence packing that keeps documents apart: the patch records, ``enable_packing`` and ``packing_status``.

Records are grouped by Transformers epoch; each group is the complete set for its releases:

======================  =====================================================================
epoch                   what differs (and why a patch written for one breaks on the next)
======================  =====================================================================
``<4.53``               no ``masking_utils``: masks are built inside each model file. Refused.
``4.53-5.3``            mask builders take ``cache_position`` and ``past_key_values``;
                        ``_preprocess_mask_arguments`` returns 5 values (5.0-5.3: the same
                        builder signature).
``5.4-5.23``            ``cache_position`` gone, still ``past_key_values``; the preprocessor
                        returns 7 values.
``>=5.24``              ``past_key_values`` renamed ``cache``.
======================  =====================================================================

The patches never touch the preprocessor's return tuple (which is what drifts); they replace
the mask builders in ``masking_utils`` and in every model module that imported them, and
install a guard in the preprocessor that raises when an indexed mask arrives from a module
they do not cover. The probes check each target's real signature, and that a model module's
builder *is* ``masking_utils``'s (a module with its own mask code is refused, not left leaking).

Beyond the masks, records (4.53+, all epochs) make MoE load-balancing losses count each real
token once, and guard what cannot be made document-aware: ``create_recurrent_attention_mask``
(releases that have it) and the ``forward`` of refused families that bypass masking_utils.
Which families are refused, and why, is data in :mod:`model_patches.capabilities`.
"""

from __future__ import annotations

import functools
import logging
import sys
from typing import Callable, Optional, Sequence

import torch

from .guards import build_forward_guard, build_guard, build_recurrent_mask, forward_probe, guard_probe, recurrent_probe
from .packing_patches import build_mask_builder, build_unpad, mask_builder_probe, same_function_probe, unpad_probe
from .aux_loss import AUX_LOSS_NAME, aux_loss_modules, aux_loss_probe, build_aux_loss
from .alibi import ALIBI_NAME, alibi_probe, build_alibi
from .capabilities import CAPABILITIES, made_correct_targets, refusals_for_model
from .document_mixers import build_mixer, mixer_probe
from .registry import PatchHandle, PatchRecord, StatusRow, apply_records, is_applied, live_records, record_status

__all__ = ["enable_packing", "packing_status", "packing_records", "check_model", "FAMILIES", "MOE_FAMILIES", "EPOCHS"]

logger = logging.getLogger(__name__)

#: Model modules covered by name (tested: llama, qwen3, mistral, gemma3, qwen3_moe). Any other
#: ``transformers.models.*.modeling_*`` module already imported when ``enable_packing()`` runs
#: and using the same builders is covered too.
FAMILIES: tuple[str, ...] = (
    "llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "gemma2", "gemma3",
    "phi3", "olmo2", "granite", "starcoder2", "cohere",
)
#: MoE families whose load-balancing loss is patched by name (others: when already imported).
MOE_FAMILIES: tuple[str, ...] = ("mixtral", "qwen2_moe", "qwen3_moe")
_BUILDERS = ("create_causal_mask", "create_sliding_window_causal_mask")

#: epoch label -> (version specifier, cache argument name, builders take cache_position)
EPOCHS: dict[str, tuple[str, str, bool]] = {
    "4.53-5.3": (">=4.53,<5.4", "past_key_values", True),
    "5.4-5.23": (">=5.4,<5.24", "past_key_values", False),
    "5.24+": (">=5.24", "cache", False),
}

_MU = "transformers.masking_utils"
_FU = "transformers.modeling_flash_attention_utils"


def _refuse_old(_: object) -> Optional[str]:
    return (
        "packing needs transformers.masking_utils (Transformers 4.53 or newer); older releases "
        "build masks inside each model file, which these patches do not cover"
    )


@functools.lru_cache(maxsize=None)
def _builder_record(module: str, name: str, epoch: str) -> PatchRecord:
    versions, cache_arg, has_cp = EPOCHS[epoch]
    target = f"{module}:{name}"
    is_source = module == _MU
    probe = mask_builder_probe(cache_arg, has_cp) if is_source else same_function_probe(name, cache_arg, has_cp)
    short = module.rsplit(".", 1)[-1]
    return _made(PatchRecord(
        name=f"{short}.{name} (indexed 2D mask -> same-document mask)",
        target=target,
        versions=versions,
        probe=probe,
        build=build_mask_builder(target, cache_arg),
        epoch=epoch,
        doc="eager/sdpa/flex: and_mask_function over document ids; flash: document-id mask",
    ))


#: Every packing record made (so :func:`packing_status` can tell them from other live records).
_MADE: set[PatchRecord] = set()


def _made(record: PatchRecord) -> PatchRecord:
    _MADE.add(record)
    return record


def _model_module_record(target: str, name: str, probe: Callable, build: Callable, doc: str) -> PatchRecord:
    """A record on a model module's attribute, for every release with masking_utils (4.53+)."""
    return _made(PatchRecord(name=name, target=target, versions=">=4.53", probe=probe, build=build,
                             epoch="4.53+", doc=doc))


@functools.lru_cache(maxsize=None)
def _aux_loss_record(module: str) -> PatchRecord:
    return _model_module_record(
        f"{module}:{AUX_LOSS_NAME}", f"{module.rsplit('.', 1)[-1]}.{AUX_LOSS_NAME} (each real token counts once)",
        aux_loss_probe, build_aux_loss, "MoE load-balancing loss: an indexed mask becomes a 0/1 validity mask",
    )


@functools.lru_cache(maxsize=None)
def _common_records() -> tuple[PatchRecord, ...]:
    return (
        PatchRecord(
            name="Transformers before masking_utils (refused)",
            target="transformers:PreTrainedModel",
            versions="<4.53",
            probe=_refuse_old,
            build=lambda original: original,
            epoch="<4.53",
        ),
        PatchRecord(
            name="masking_utils._preprocess_mask_arguments (guard: refuse uncovered modules)",
            target=f"{_MU}:_preprocess_mask_arguments",
            versions=">=4.53",
            probe=guard_probe,
            build=build_guard,
            epoch="4.53+",
        ),
        PatchRecord(
            name="modeling_flash_attention_utils._get_unpad_data (per-document cu_seqlens)",
            target=f"{_FU}:_get_unpad_data",
            versions=">=4.53",
            probe=unpad_probe,
            build=build_unpad,
            epoch="4.53+",
        ),
    )


_RECURRENT = "create_recurrent_attention_mask"


def _recurrent_records() -> list[PatchRecord]:
    """Guards on ``create_recurrent_attention_mask`` (Transformers releases that have it), in
    masking_utils and in every imported model module holding it (stock or a packing wrapper)."""
    mu = sys.modules.get(_MU)
    if mu is None or not hasattr(mu, _RECURRENT):
        return []
    stock = getattr(getattr(mu, _RECURRENT), "_packing_original", getattr(mu, _RECURRENT))
    modules = [_MU] + sorted(
        name for name, mod in list(sys.modules.items())
        if name.startswith("transformers.models.") and ".modeling_" in name and mod is not None
        and getattr(vars(mod).get(_RECURRENT), "_packing_original", vars(mod).get(_RECURRENT)) is stock
    )
    return [_recurrent_record(m) for m in modules]


@functools.lru_cache(maxsize=None)
def _recurrent_record(module: str) -> PatchRecord:
    target = f"{module}:{_RECURRENT}"
    return _model_module_record(
        target, f"{module.rsplit('.', 1)[-1]}.{_RECURRENT} (document ids for per-document mixers, else refuse indexed masks)",
        recurrent_probe, build_recurrent_mask(target),
        "Mamba / linear-attention / conv layers would scale tokens by document id and carry state",
    )


def _made_correct_records() -> list[PatchRecord]:
    """Records that make a refused capability correct in a family (ALiBi from per-document
    positions, mixers run per document), for every such target whose module is imported.

    A family whose module is imported only later stays refused until ``enable_packing`` runs
    again (or is given the model), because its targets are not patched.
    """
    records = []
    for target in made_correct_targets():
        module, _, attr = target.partition(":")
        if module not in sys.modules or attr == _RECURRENT:  # the recurrent builders: _recurrent_records
            continue
        if attr == ALIBI_NAME:
            records.append(_alibi_record(module))
        elif attr.endswith(".forward"):
            records.append(_mixer_record(target))
    return records


@functools.lru_cache(maxsize=None)
def _alibi_record(module: str) -> PatchRecord:
    return _model_module_record(
        f"{module}:{ALIBI_NAME}", f"{module.rsplit('.', 1)[-1]}.{ALIBI_NAME} (ALiBi from per-document positions)",
        alibi_probe, build_alibi, "every key positioned inside its own document, as when that document runs alone",
    )


@functools.lru_cache(maxsize=None)
def _mixer_record(target: str) -> PatchRecord:
    return _model_module_record(
        target, f"{target.partition(':')[2]} (stateful mixer run per document)", mixer_probe, build_mixer,
        "each document of a packed row runs from a fresh state (length-grouped segments)",
    )


@functools.lru_cache(maxsize=None)
def _forward_guard_records() -> tuple[PatchRecord, ...]:
    """Guards on ``*ForCausalLM.forward`` of families (refused, or made correct) that never call masking_utils
    (imported here, about 0.5 s once per process; families this release lacks are left out)."""
    import importlib

    from transformers.models.auto.configuration_auto import model_type_to_module_name
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    records = []
    for cap in CAPABILITIES:
        for family in cap.forward_guard:
            cls = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(family)
            short = model_type_to_module_name(family)
            module = f"transformers.models.{short}.modeling_{short}"
            try:
                owner = getattr(importlib.import_module(module), cls) if cls is not None else None
            except ImportError:
                owner = None
            # a forward without an attention_mask parameter cannot receive an indexed mask
            present = owner is not None and forward_probe(owner.forward) is None
            if present:
                records.append(_made(PatchRecord(
                    name=f"{cls}.forward (guard: {cap.name})",
                    target=f"{module}:{cls}.forward",
                    versions=">=4.53",
                    probe=forward_probe,
                    build=build_forward_guard(family),
                    epoch="4.53+",
                    doc=cap.reason,
                )))
    return tuple(records)


def _discovered_modules() -> list[str]:
    """Already-imported model modules that use masking_utils' builders, beyond :data:`FAMILIES`."""
    mu = sys.modules.get(_MU)
    if mu is None:
        return []
    refs = {getattr(getattr(mu, n, None), "_packing_original", getattr(mu, n, None)) for n in _BUILDERS}
    found = []
    for name, mod in list(sys.modules.items()):
        if not name.startswith("transformers.models.") or ".modeling_" not in name or mod is None:
            continue
        namespace = getattr(mod, "__dict__", {})
        held = [getattr(namespace[n], "_packing_original", namespace[n]) for n in _BUILDERS if n in namespace]
        if any(h in refs for h in held):  # the stock builder, or a packing wrapper around it
            found.append(name)
    return sorted(found)


def packing_records(extra_modules: Sequence[str] = ()) -> list[PatchRecord]:
    """Every packing record, grouped by epoch (all epochs; gates pick the installed one).

    Covers ``masking_utils``, each family of :data:`FAMILIES`, each already-imported model module
    that uses the same builders, and ``extra_modules`` (full module names).
    """
    records = list(_common_records())
    _MADE.update(records)
    modules = [f"transformers.models.{f}.modeling_{f}" for f in FAMILIES]
    modules += [m for m in [*_discovered_modules(), *extra_modules] if m not in modules]
    moe = [f"transformers.models.{f}.modeling_{f}" for f in MOE_FAMILIES]
    moe += [m for m in [*aux_loss_modules(), *extra_modules] if m not in moe and _defines_aux_loss(m)]
    records.extend(_aux_loss_record(m) for m in moe)
    guards = _forward_guard_records()  # imports the guarded families' modules: their mixer records below
    records.extend(_recurrent_records())
    records.extend(_made_correct_records())
    records.extend(guards)
    for epoch in EPOCHS:
        records.append(_builder_record(_MU, _BUILDERS[0], epoch))
        records.append(_builder_record(_MU, _BUILDERS[1], epoch))
        for module in modules:
            names = _module_builders(module)
            records.extend(_builder_record(module, n, epoch) for n in names)
    return records


def _defines_aux_loss(module: str) -> bool:
    mod = sys.modules.get(module)
    return mod is not None and callable(vars(mod).get(AUX_LOSS_NAME))


def _module_builders(module: str) -> tuple[str, ...]:
    """The builders ``module`` imported (all of them once it is imported: a module may import only
    the sliding-window one); for a named family not imported yet, what it is known to import."""
    mod = sys.modules.get(module)
    if mod is not None:
        return tuple(n for n in _BUILDERS if n in vars(mod))
    fam = module.rsplit(".modeling_", 1)[-1]
    return _BUILDERS if _has_sliding(fam, module) else _BUILDERS[:1]


def _has_sliding(family: str, module: str) -> bool:
    if family in ("llama", "olmo2", "granite", "cohere"):
        return False
    mod = sys.modules.get(module)
    return mod is None or family in FAMILIES or hasattr(mod, _BUILDERS[1])


def enable_packing(
    *, strict: bool = True, extra_modules: Sequence[str] = (), model: Optional[torch.nn.Module] = None
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
    """
    if model is not None:
        _refuse_capabilities(model, assume_patched=True)
        own = [m for m in _model_modules(model) if any(n in vars(sys.modules[m]) for n in (*_BUILDERS, AUX_LOSS_NAME, _RECURRENT))]
        extra_modules = [*extra_modules, *own]
    handle = apply_records(packing_records(extra_modules), strict=strict)
    applied = sum(r.state == "applied" for r in handle.rows)
    logger.info("packing patches: %d applied, %d rows", applied, len(handle.rows))
    if model is not None:
        try:
            check_model(model)
        except ValueError:
            handle.remove()
            raise
    return handle


def _model_modules(model: torch.nn.Module) -> list[str]:
    return sorted(
        {type(m).__module__ for m in model.modules() if type(m).__module__.startswith("transformers.models.")}
        & {n for n in sys.modules if ".modeling_" in n}
    )


def check_model(model: torch.nn.Module) -> None:
    """Raise ``ValueError`` unless every Transformers model module used by ``model`` is covered now.

    Covered = every capability that mixes information along the sequence outside the attention
    masks (ALiBi, recurrent / convolutional / linear-attention mixers: see
    :mod:`model_patches.capabilities`) is absent or made correct by live records, and each
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
        builders = [namespace[n] for n in _BUILDERS if n in namespace]
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
            f"{', '.join(FAMILIES)}), or train this model without packing"
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


def packing_status(extra_modules: Sequence[str] = ()) -> list[StatusRow]:
    """One row per record: name, target, versions, state (applied/available/skipped/failed/refused), reason.

    Lists every packing record that is live however it was applied (plain ``enable_packing()``,
    ``model=``, ``extra_modules``, or a module discovered at the time), then one ``refused`` row
    per capability of :data:`model_patches.capabilities.CAPABILITIES` with families it still
    refuses (or checks), and why, preceded by a ``made correct`` row listing the families where packing
    makes that capability document-aware (``applied`` while packing is on and every imported
    family's records are live, ``available`` otherwise).
    """
    records = packing_records(extra_modules)
    known = {r.target for r in records}
    records += [r for r in live_records() if r.target not in known and r in _MADE]
    rows = record_status(records)
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
