"""The packing records, as a table: what is patched, for which releases, checked how, replaced by what.

Each :class:`Row` below is one line of the table. A row whose target holds ``{module}`` stands
for one record per module of its ``each`` set, the one expansion of this table: *for each
imported modeling module that holds the row's attribute* (``transformers.models.<f>.modeling_<f>``),
with these sets:

======================  =====================================================================
``each``                the modules (or targets) a row expands over
======================  =====================================================================
``"mask users"``        ``masking_utils`` itself, the families named in :data:`COVERED_FAMILIES`
                        (imported or not: a named family that drifts fails loudly), every other
                        imported model module holding ``masking_utils``' own builder, and the
                        caller's ``extra_modules``; each holding this row's builder
``"moe"``               :data:`MOE_FAMILIES`, and imported modules (or ``extra_modules``) that
                        define ``load_balancing_loss_func``
``"recurrent"``         ``masking_utils`` and imported modules holding its own
                        ``create_recurrent_attention_mask`` (releases that have it)
``"alibi"``,            targets of :data:`.coverage.CAPABILITIES` ``made_correct`` whose module
``"mixers"``            is imported: ALiBi builders; stateful mixers' ``forward``
``"forward guard"``     ``*ForCausalLM.forward`` of the families a capability guards by forward
                        (imported here; families this release lacks are left out)
======================  =====================================================================

Epochs (each group of mask-builder rows is the complete set for its releases):

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
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from typing import Any, Callable, Optional, Sequence

from ..registry import PatchRecord
from ..targets import mask_arguments_probe, model_modules, unwrapped
from .aux_loss import AUX_LOSS_NAME, aux_loss_probe, build_aux_loss
from .coverage import CAPABILITIES, made_correct_targets
from .guards import build_forward_guard, build_guard, build_recurrent_mask, forward_probe
from .mask_builders import (
    build_mask_builder,
    build_unpad,
    cache_capacity_probe,
    mask_builder_probe,
    same_function_probe,
    unpad_probe,
)

__all__ = [
    "Row", "PACKING_TABLE", "COVERED_FAMILIES", "MOE_FAMILIES", "EPOCHS", "MASK_PATH_TARGETS", "packing_records",
    "is_packing_record",
]

#: Model families covered by name (tested: llama, qwen3, mistral, gemma3, qwen3_moe). Any other
#: model module already imported when ``enable_packing()`` runs and using the same builders is
#: covered too.
COVERED_FAMILIES: tuple[str, ...] = (
    "llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "gemma2", "gemma3",
    "phi3", "olmo2", "granite", "starcoder2", "cohere",
)
#: MoE families whose load-balancing loss is patched by name (others: when already imported).
MOE_FAMILIES: tuple[str, ...] = ("mixtral", "qwen2_moe", "qwen3_moe")

#: epoch label -> (version specifier, cache argument name, builders take cache_position)
EPOCHS: dict[str, tuple[str, str, bool]] = {
    "4.53-5.3": (">=4.53,<5.4", "past_key_values", True),
    "5.4-5.23": (">=5.4,<5.24", "past_key_values", False),
    "5.24+": (">=5.24", "cache", False),
}

MU = "transformers.masking_utils"
FU = "transformers.modeling_flash_attention_utils"
CU = "transformers.cache_utils"
BUILDERS = ("create_causal_mask", "create_sliding_window_causal_mask")
RECURRENT = "create_recurrent_attention_mask"
ALIBI = "build_alibi_tensor"
#: What an indexed mask needs on every backend, in every epoch: the guard that refuses uncovered
#: modules, masking_utils' builders (eager / sdpa / flex) and flash's per-document cu_seqlens.
MASK_PATH_TARGETS: tuple[str, ...] = (
    f"{MU}:_preprocess_mask_arguments", *(f"{MU}:{name}" for name in BUILDERS), f"{FU}:_get_unpad_data",
)

#: What a row's probe or builder is made from: the expanded fields (``target``, ``module``, ...).
Fields = dict[str, str]


@dataclasses.dataclass(frozen=True)
class Row:
    """One line of :data:`PACKING_TABLE` (see the module docstring).

    ``name`` and ``target`` may hold ``{module}``, ``{short}`` (the module's last part),
    ``{attr}`` and, for forward guards, ``{family}`` / ``{capability}``. ``probe`` and ``build``
    make the record's probe and builder from those fields.
    """

    name: str
    target: str
    versions: str
    epoch: str
    probe: Callable[[Fields], Callable[[Any], Optional[str]]]
    build: Callable[[Fields], Callable[[Any], Any]]
    each: str = ""
    doc: str = ""


def _fixed(fn: Callable) -> Callable[[Fields], Callable]:
    """A probe or builder that does not depend on the expanded fields."""
    return lambda fields: fn


def _refuse_old(_: object) -> Optional[str]:
    return (
        "packing needs transformers.masking_utils (Transformers 4.53 or newer); older releases "
        "build masks inside each model file, which these patches do not cover"
    )


def _builder_row(name: str, epoch: str) -> Row:
    versions, cache_arg, has_cp = EPOCHS[epoch]
    return Row(
        name=f"{{short}}.{name} (indexed 2D mask -> same-document mask)", target=f"{{module}}:{name}",
        versions=versions, epoch=epoch, each="mask users",
        probe=lambda f: (mask_builder_probe(cache_arg, has_cp) if f["module"] == MU
                         else same_function_probe(name, cache_arg, has_cp)),
        build=lambda f: build_mask_builder(f["target"], cache_arg),
        doc="eager/sdpa/flex: and_mask_function over document ids; flash: document-id mask",
    )


#: Every packing record, in the order they are applied (see the module docstring).
PACKING_TABLE: tuple[Row, ...] = (
    Row("Transformers before masking_utils (refused)", "transformers:PreTrainedModel", "<4.53", "<4.53",
        probe=_fixed(_refuse_old), build=_fixed(lambda original: original)),
    Row("masking_utils._preprocess_mask_arguments (guard: refuse uncovered modules)",
        f"{MU}:_preprocess_mask_arguments", ">=4.53", "4.53+",
        probe=_fixed(mask_arguments_probe), build=_fixed(build_guard)),
    Row("modeling_flash_attention_utils._get_unpad_data (per-document cu_seqlens)", f"{FU}:_get_unpad_data",
        ">=4.53", "4.53+", probe=_fixed(unpad_probe), build=_fixed(build_unpad)),
    Row("cache_utils.Cache (capacity read for static caches; checked, not replaced)", f"{CU}:Cache",
        ">=4.53", "4.53+", probe=_fixed(cache_capacity_probe), build=_fixed(lambda original: original),
        doc="document ids are padded to a static cache's length, which the mask functions index"),
    Row(f"{{short}}.{AUX_LOSS_NAME} (each real token counts once)", f"{{module}}:{AUX_LOSS_NAME}", ">=4.53", "4.53+",
        probe=_fixed(aux_loss_probe), build=_fixed(build_aux_loss), each="moe",
        doc="MoE load-balancing loss: an indexed mask becomes a 0/1 validity mask"),
    Row(f"{{short}}.{RECURRENT} (document ids for per-document mixers, else refuse indexed masks)",
        f"{{module}}:{RECURRENT}", ">=4.53", "4.53+", each="recurrent",
        probe=_fixed(mask_arguments_probe), build=lambda f: build_recurrent_mask(f["target"]),
        doc="Mamba / linear-attention / conv layers would scale tokens by document id and carry state"),
    Row(f"{{short}}.{ALIBI} (ALiBi from per-document positions)", f"{{module}}:{ALIBI}", ">=4.53", "4.53+",
        probe=lambda f: _alibi()[0], build=lambda f: _alibi()[1], each="alibi",
        doc="every key positioned inside its own document, as when that document runs alone"),
    Row("{attr} (stateful mixer run per document)", "{module}:{attr}", ">=4.53", "4.53+",
        probe=lambda f: _mixers()[0], build=lambda f: _mixers()[1], each="mixers",
        doc="each document of a packed row runs from a fresh state (length-grouped segments)"),
    Row("{attr} (guard: {capability})", "{module}:{attr}", ">=4.53", "4.53+", each="forward guard",
        probe=_fixed(forward_probe), build=lambda f: build_forward_guard(f["family"]), doc="{reason}"),
    _builder_row("create_causal_mask", "4.53-5.3"),
    _builder_row("create_sliding_window_causal_mask", "4.53-5.3"),
    _builder_row("create_causal_mask", "5.4-5.23"),
    _builder_row("create_sliding_window_causal_mask", "5.4-5.23"),
    _builder_row("create_causal_mask", "5.24+"),
    _builder_row("create_sliding_window_causal_mask", "5.24+"),
)


# The ALiBi and mixer builders are imported when a record of theirs is made (their families'
# modules are imported), not for every enable_packing().
def _alibi() -> tuple[Callable, Callable]:
    from .alibi import alibi_probe, build_alibi

    return alibi_probe, build_alibi


def _mixers() -> tuple[Callable, Callable]:
    from .document_mixers import build_mixer, mixer_probe

    return mixer_probe, build_mixer


# ---- the expansion: for each imported modeling module (see the module docstring) -------------


def _family_module(family: str) -> str:
    return f"transformers.models.{family}.modeling_{family}"


def _mask_users(extra_modules: Sequence[str]) -> list[Fields]:
    mu = sys.modules.get(MU)
    stock = {unwrapped(getattr(mu, n, None)) for n in BUILDERS} if mu is not None else set()
    discovered = model_modules(BUILDERS, stock) if stock else []
    modules = [_family_module(f) for f in COVERED_FAMILIES]
    modules += [m for m in [*discovered, *extra_modules] if m not in modules]
    return [{"module": MU, "attr": n} for n in BUILDERS] + [
        {"module": m, "attr": n} for m in modules for n in _module_builders(m)
    ]


def _module_builders(module: str) -> tuple[str, ...]:
    """The builders ``module`` imported (all of them once it is imported: a module may import only
    the sliding-window one); for a named family not imported yet, what it is known to import."""
    mod = sys.modules.get(module)
    if mod is not None:
        return tuple(n for n in BUILDERS if n in vars(mod))
    family = module.rsplit(".modeling_", 1)[-1]
    return BUILDERS[:1] if family in ("llama", "olmo2", "granite", "cohere") else BUILDERS


def _moe(extra_modules: Sequence[str]) -> list[Fields]:
    def defines(module: str) -> bool:
        mod = sys.modules.get(module)
        return mod is not None and callable(vars(mod).get(AUX_LOSS_NAME))

    modules = [_family_module(f) for f in MOE_FAMILIES]
    found = model_modules((AUX_LOSS_NAME,))
    modules += [m for m in [*found, *extra_modules] if m not in modules and defines(m)]
    return [{"module": m, "attr": AUX_LOSS_NAME} for m in modules]


def _recurrent(extra_modules: Sequence[str]) -> list[Fields]:
    mu = sys.modules.get(MU)
    if mu is None or not hasattr(mu, RECURRENT):
        return []
    stock = unwrapped(getattr(mu, RECURRENT))
    holders = model_modules((RECURRENT,), {stock})
    return [{"module": m, "attr": RECURRENT} for m in [MU, *holders]]


def _made_correct(kind: Callable[[str], bool]) -> Callable[[Sequence[str]], list[Fields]]:
    """Made-correct targets whose attribute is of ``kind`` and whose module is imported (a family
    imported later stays refused until ``enable_packing`` runs again, or is given the model)."""

    def expand(extra_modules: Sequence[str]) -> list[Fields]:
        fields = []
        for target in made_correct_targets():
            module, _, attr = target.partition(":")
            if module in sys.modules and kind(attr):
                fields.append({"module": module, "attr": attr})
        return fields

    return expand


def _forward_guards(extra_modules: Sequence[str]) -> list[Fields]:
    """``*ForCausalLM.forward`` of families guarded by forward (imported here, about 0.5 s once)."""
    from transformers.models.auto.configuration_auto import model_type_to_module_name
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    fields = []
    for cap in CAPABILITIES:
        for family in cap.forward_guard:
            cls = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(family)
            module = _family_module(model_type_to_module_name(family))
            try:
                owner = getattr(importlib.import_module(module), cls) if cls is not None else None
            except ImportError:
                owner = None
            # a forward without an attention_mask parameter cannot receive an indexed mask
            if owner is not None and forward_probe(owner.forward) is None:
                fields.append({"module": module, "attr": f"{cls}.forward", "family": family,
                               "capability": cap.name, "reason": cap.reason})
    return fields


#: The expansions, run in this order: the forward guards import the guarded families' modules,
#: whose mixers the made-correct sets then find.
_EACH: dict[str, Callable[[Sequence[str]], list[Fields]]] = {
    "forward guard": _forward_guards,
    "mask users": _mask_users,
    "moe": _moe,
    "recurrent": _recurrent,
    "alibi": _made_correct(lambda attr: attr == ALIBI),
    "mixers": _made_correct(lambda attr: attr.endswith(".forward")),
}

#: (row, target) -> its record: the same record object every time, so that enabling twice is a no-op.
_RECORDS: dict[tuple[Row, str], PatchRecord] = {}


def _record(row: Row, fields: Fields) -> PatchRecord:
    fields = {**fields, "short": fields.get("module", "").rsplit(".", 1)[-1]}
    target = row.target.format(**fields)
    fields["target"] = target
    key = (row, target)
    if key not in _RECORDS:
        _RECORDS[key] = PatchRecord(
            name=row.name.format(**fields), target=target, versions=row.versions,
            probe=row.probe(fields), build=row.build(fields), epoch=row.epoch,
            doc=row.doc.format(**fields), table="packing",
        )
    return _RECORDS[key]


def packing_records(extra_modules: Sequence[str] = ()) -> list[PatchRecord]:
    """Every packing record now: :data:`PACKING_TABLE` expanded over the imported modeling modules.

    ``extra_modules``: more module names (full names) to cover with the mask-builder and MoE rows.
    """
    expanded = {each: expand(extra_modules) for each, expand in _EACH.items()}
    records: list[PatchRecord] = []
    for row in PACKING_TABLE:
        if not row.each:
            records.append(_record(row, {}))
            continue
        # a row stands for the modules of its set that hold its attribute
        fits = (lambda f: True) if "{attr}" in row.target else (lambda f: row.target.endswith(":" + f["attr"]))
        records.extend(_record(row, f) for f in expanded[row.each] if fits(f))
    return records


def is_packing_record(record: PatchRecord) -> bool:
    """Whether ``record`` was made from :data:`PACKING_TABLE`."""
    return record.table == "packing"
