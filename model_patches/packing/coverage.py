"""What a family must have document-aware before packing is safe: one record per capability.

Keeping documents apart needs more than the attention mask. Anything else that mixes
information along the sequence must respect document boundaries too:

- a position bias built from the mask (ALiBi from ``attention_mask.cumsum()``): document ids
  turn into wrong distances;
- a recurrent, convolutional or linear-attention mixer (Mamba / SSM, short convolutions,
  gated delta nets, RWKV, xLSTM): its state runs from one document straight into the next,
  whatever the mask says;
- absolute position embeddings (GPT-2 style) fed row positions instead of per-document ones.

Each :class:`Capability` is data: the families (``config.model_type``) it applies to, an optional
condition on the config (Falcon uses ALiBi only with ``alibi=True``), an optional structural
detector ``(fqn, module) -> bool`` that finds the same thing in a model whatever its family,
how packing handles it, and why. A new family is one more name in a record.

Handling:

- ``"refused"``: ``enable_packing(model=...)`` raises at entry, and with plain
  ``enable_packing()`` the patched mask builders raise when an indexed mask reaches such a
  family (0/1 padding masks still work as in stock Transformers).
- ``"per_document_positions"``: accepted only with per-document ``position_ids`` (what
  ``PackingCollator`` returns); the mask builders check the positions they receive against
  the document layout and refuse row positions.

A refused capability can be *made correct* family by family: ``made_correct`` maps a family to
the patch targets (``"module:attr"``) whose packing records make that capability
document-aware there (ALiBi from per-document positions, :mod:`model_patches.packing.alibi`; mixers run
per document, :mod:`model_patches.packing.document_mixers`). The family is accepted while every one of
its targets is patched by a live handle, and refused otherwise (say the release lacks a target
or a probe failed), so a record that did not apply never leaves a silent leak.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import torch

from ..registry import is_applied

__all__ = [
    "Capability",
    "CAPABILITIES",
    "capabilities_for_config",
    "refusals_for_model",
    "detected_in",
    "made_correct_targets",
]

Detector = Callable[[str, torch.nn.Module], bool]


@dataclasses.dataclass(frozen=True)
class Capability:
    """One sequence-mixing capability and how packing handles it (see module docstring)."""

    name: str
    families: tuple[str, ...]
    handling: str
    reason: str
    when: Optional[Callable[[Any], bool]] = None
    detect: Optional[Detector] = None
    #: families (of ``families``) whose masks and mixers never pass through masking_utils: plain
    #: ``enable_packing()`` guards their ``*ForCausalLM.forward`` instead of the mask builders.
    forward_guard: tuple[str, ...] = ()
    #: (family, patch targets) pairs: families this capability is made correct in, and how.
    made_correct: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def __post_init__(self) -> None:
        if self.handling not in ("refused", "per_document_positions"):
            raise ValueError(
                f"Capability.handling must be 'refused' or 'per_document_positions', got {self.handling!r}"
            )

    def applies_to(self, config: Any) -> bool:
        """Whether this capability is present in a model with ``config`` (by family and condition)."""
        if getattr(config, "model_type", None) not in self.families:
            return False
        return self.when is None or bool(self.when(config))

    def targets_for(self, family: Optional[str]) -> tuple[str, ...]:
        """Patch targets that make this capability document-aware in ``family`` (empty: none)."""
        return dict(self.made_correct).get(family or "", ())

    def covers(self, config: Any, assume_patched: bool = False) -> bool:
        """Whether ``config``'s family is made correct: every target patched now (or, with
        ``assume_patched``, about to be: the check before ``enable_packing`` applies its records)."""
        targets = self.targets_for(getattr(config, "model_type", None))
        return bool(targets) and (assume_patched or all(is_applied(t) for t in targets))


def _has_parameter(*names: str) -> Detector:
    def has_parameter(fqn: str, module: torch.nn.Module) -> bool:
        return any(n in module._parameters for n in names)

    has_parameter.__name__ = f"has_parameter{names}"
    return has_parameter


def _sequence_convolution(fqn: str, module: torch.nn.Module) -> bool:
    """A depthwise Conv1d over the sequence (Mamba's and LFM2's causal short convolutions)."""
    return (
        isinstance(module, torch.nn.Conv1d)
        and module.kernel_size[0] > 1
        and module.groups == module.in_channels
        and module.groups > 1
    )


_RECURRENT_CLASS_WORDS = ("Mamba", "GatedDeltaNet", "LinearAttention", "Lightning", "Rwkv", "xLSTM", "Recurrent", "ShortConv")


def _recurrent_class(fqn: str, module: torch.nn.Module) -> bool:
    """A module named like a recurrent mixer (norms and embeddings of such families excluded)."""
    name = type(module).__name__
    if name.endswith(("Model", "ForCausalLM", "Config")) or "Norm" in name or "Embedding" in name:
        return False
    return any(word in name for word in _RECURRENT_CLASS_WORDS)


def _any(*detectors: Detector) -> Detector:
    def any_of(fqn: str, module: torch.nn.Module) -> bool:
        return any(d(fqn, module) for d in detectors)

    any_of.__name__ = " | ".join(d.__name__ for d in detectors)
    return any_of


def _module(short: str) -> str:
    return f"transformers.models.{short}.modeling_{short}"


def _alibi_family(family: str) -> tuple[str, tuple[str, ...]]:
    """ALiBi built by ``modeling_<family>.build_alibi_tensor`` from the 2D mask."""
    return family, (f"{_module(family)}:build_alibi_tensor",)


def _mixer_family(family: str, *mixers: str, module: str = "", recurrent_mask: bool = True) -> tuple[str, tuple[str, ...]]:
    """Mixer classes of ``modeling_<module or family>`` that run per document once their
    ``forward`` is patched. They get their mask from ``create_recurrent_attention_mask`` (patched
    too), or with ``recurrent_mask=False`` straight from the model's ``attention_mask`` (Mamba)."""
    path = _module(module or family)
    builder = (f"{path}:create_recurrent_attention_mask",) if recurrent_mask else ()
    return family, (*builder, *(f"{path}:{m}.forward" for m in mixers))


#: Every capability packing knows about, as data.
CAPABILITIES: tuple[Capability, ...] = (
    Capability(
        name="alibi",
        families=("bloom", "falcon"),
        handling="refused",
        when=lambda c: c.model_type != "falcon" or bool(getattr(c, "alibi", False)),
        made_correct=(_alibi_family("bloom"), _alibi_family("falcon")),
        reason=(
            "ALiBi position bias built from attention_mask.cumsum(): document ids distort the "
            "distances and later documents get the wrong bias"
        ),
    ),
    Capability(
        name="stateful_mixer",
        families=(
            "mamba", "mamba2", "falcon_mamba", "jamba", "bamba", "falcon_h1", "zamba", "zamba2",
            "granitemoehybrid", "nemotron_h", "lfm2", "lfm2_moe", "lfm3", "qwen3_next", "qwen3_5",
            "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen4_exp", "qwen4_exp_text",
            "kimi_linear", "minimax", "olmo_hybrid", "recurrent_gemma", "rwkv", "xlstm",
            "bailing_hybrid", "glm5_next", "zaya", "inkling_text", "inkling2_text", "inkling2_loop_text", "lara_mini",
        ),
        handling="refused",
        detect=_any(_has_parameter("A_log", "dt_bias"), _sequence_convolution, _recurrent_class),
        forward_guard=("mamba", "mamba2", "falcon_mamba", "rwkv", "xlstm"),
        made_correct=(
            _mixer_family("qwen3_next", "Qwen3NextGatedDeltaNet"),
            _mixer_family("qwen3_5_text", "Qwen3_5GatedDeltaNet", module="qwen3_5"),
            _mixer_family("qwen3_5_moe_text", "Qwen3_5MoeGatedDeltaNet", module="qwen3_5_moe"),
            _mixer_family("olmo_hybrid", "OlmoHybridGatedDeltaNet"),
            _mixer_family("lara_mini", "LaraMiniGatedDeltaNet"),
            _mixer_family("minimax", "MiniMaxLightningAttention"),
            _mixer_family("bamba", "BambaMixer"),
            _mixer_family("jamba", "JambaMambaMixer"),
            _mixer_family("falcon_h1", "FalconH1Mixer"),
            _mixer_family("granitemoehybrid", "GraniteMoeHybridMambaLayer"),
            _mixer_family("nemotron_h", "NemotronHMamba2Mixer"),
            _mixer_family("zamba2", "Zamba2MambaMixer"),
            _mixer_family("lfm2", "Lfm2ShortConv"),
            _mixer_family("lfm3", "Lfm3ShortConv"),
            _mixer_family("mamba2", "Mamba2Mixer"),
            _mixer_family("lfm2_moe", "Lfm2MoeShortConv"),
            _mixer_family("kimi_linear", "KimiLinearDeltaAttention"),
            _mixer_family("bailing_hybrid", "BailingHybridDeltaAttention"),
            _mixer_family("mamba", "MambaMixer", recurrent_mask=False),
            _mixer_family("falcon_mamba", "FalconMambaMixer", recurrent_mask=False),
        ),
        reason=(
            "recurrent / convolutional / linear-attention mixer: its state carries from one "
            "document into the next whatever the attention mask says"
        ),
    ),
    Capability(
        name="own_masks",
        families=("cpmant", "openai-gpt", "xlm", "xlnet", "reformer", "prophetnet"),
        handling="refused",
        forward_guard=("cpmant", "openai-gpt", "xlm", "xlnet", "reformer", "prophetnet"),
        reason=(
            "builds its attention masks outside masking_utils, where the packing patches cannot "
            "make them document-aware"
        ),
    ),
    Capability(
        name="absolute_positions",
        families=(
            "gpt2", "gpt_bigcode", "gpt_neo", "opt", "biogpt", "xglm", "ctrl", "openai-gpt",
            "trocr", "whisper", "musicgen", "musicgen_melody",
        ),
        handling="per_document_positions",
        reason=(
            "absolute position embeddings: every document must start at position 0, so pass "
            "per-document position_ids (PackingCollator returns them)"
        ),
    ),
)


def capabilities_for_config(config: Any) -> list[Capability]:
    """The capabilities of :data:`CAPABILITIES` present in a model with ``config``."""
    return [c for c in CAPABILITIES if c.applies_to(config)]


def made_correct_targets() -> list[str]:
    """Every patch target named by some capability's ``made_correct`` (in order, no repeats)."""
    out: list[str] = []
    for cap in CAPABILITIES:
        for _, targets in cap.made_correct:
            out += [t for t in targets if t not in out]
    return out


def _class_target(module: torch.nn.Module) -> str:
    return f"{type(module).__module__}:{type(module).__qualname__}.forward"


def _runs_per_document(module: torch.nn.Module, about_to_be_patched: frozenset[str]) -> bool:
    """``module``'s forward is a per-document mixer, or about to be one (its target is in
    ``about_to_be_patched``)."""
    if getattr(type(module).forward, "_packing_per_document", False) and is_applied(_class_target(module)):
        return True
    return _class_target(module) in about_to_be_patched


def detected_in(model: torch.nn.Module, capability: Capability, assume_patched: bool = False,
                trusted: frozenset[str] = frozenset()) -> Optional[str]:
    """Name of the first submodule of ``model`` in which ``capability``'s detector fires, else None.

    A mixer that runs per document (a patched ``forward``) covers itself and its submodules; a
    container that fires only by name (``JambaMambaDecoderLayer``) is covered by such a mixer
    inside it, while its other submodules are still checked. Classes defined in a ``trusted``
    module (the model module of a family this capability is made correct in, whose every mixer
    is in the record) are not checked by name: ``KimiLinearAttention`` is softmax attention.
    """
    if capability.detect is None:
        return None
    modules = list(model.named_modules())
    about_to_be_patched = frozenset(made_correct_targets()) if assume_patched else frozenset()
    covered = [fqn for fqn, module in modules if _runs_per_document(module, about_to_be_patched)]
    for fqn, module in modules:
        inside = any(fqn == c or fqn.startswith(c + ".") for c in covered)
        holds = any(c.startswith(fqn + ".") or not fqn for c in covered)
        if inside or holds or type(module).__module__ in trusted:
            continue
        if capability.detect(fqn, module):
            return fqn or type(module).__name__
    return None


def refusals_for_model(model: torch.nn.Module, assume_patched: bool = False) -> list[tuple[Capability, str]]:
    """(capability, where) for every refused capability of ``model``: by its configs' families,
    then by structure (so an unlisted family with, say, a Mamba mixer is refused too).

    A family a capability is made correct in is refused only while its records are not live
    (``assume_patched``: the check before the records are applied).
    """
    configs = {id(m.config): m.config for m in model.modules() if hasattr(m, "config")}
    out: list[tuple[Capability, str]] = []
    for cap in CAPABILITIES:
        if cap.handling != "refused":
            continue
        present = [c for c in configs.values() if cap.applies_to(c)]
        hit = next((c for c in present if not cap.covers(c, assume_patched)), None)
        if hit is not None:
            out.append((cap, f"model_type {hit.model_type!r}"))
            continue
        trusted = frozenset(
            t.partition(":")[0] for c in present for t in cap.targets_for(c.model_type)
        )  # every present config is covered here (else refused above)
        where = detected_in(model, cap, assume_patched, trusted)
        if where is not None:
            out.append((cap, f"module {where!r}"))
    return out
