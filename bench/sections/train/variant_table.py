"""The ``train`` section's variants, how each is run (its own process) and how its figures are judged.

A variant (:class:`bench.sections.train.worker.Variant`) is stock Transformers or stock plus one or more
of the library's features. Each runs in a fresh process (:func:`run_variant`) on the same data,
from the same initial weights and seed. Judging:

- losses (:func:`loss_agreement`): every step's loss against stock's, ``|diff| <= tol *
  max(1, |stock|)`` with ``tol`` by dtype (:data:`LOSS_TOLERANCE`); a packed variant is compared
  with padded stock as the same per-token mean over the same documents;
- speed and memory against stock *with the same checkpointing* and the same trainer
  (:func:`same_checkpointing`): no checkpointing against ``stock``, any checkpointing (Hugging
  Face's or a policy) against ``stock+hf_gc``; the ``trl.SFTTrainer`` variants
  (:mod:`bench.sections.train.sft`, run when TRL is installed) against ``sft`` and ``sft+hf_gc``.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any, Optional

from bench.harness import isolated
from bench.sections.train import worker
from bench.sections.train.sft import DESCRIPTIONS as SFT_DESCRIPTIONS
from bench.sections.train.sft import VARIANTS as SFT_VARIANTS
from bench.sections.train.sft import trl_available
from bench.sections.train.variant import Variant

logger = logging.getLogger(__name__)

#: name -> what it changes against stock. ``ac:non_moe`` runs on MoE models only.
VARIANTS: dict[str, Variant] = {
    "stock": Variant(),
    "stock+hf_gc": Variant(hf_gc=True),
    "hidden_loss": Variant(hidden_loss=True),
    "hidden_loss+hf_gc": Variant(hidden_loss=True, hf_gc=True),
    "ac:full": Variant(policy="full"),
    "ac:non_moe": Variant(policy="non_moe"),
    "ac:fit(0.5)": Variant(fit=0.5),
    "packing": Variant(packing=True),
    "hidden_loss+ac:full": Variant(hidden_loss=True, policy="full"),
    "all": Variant(packing=True, hidden_loss=True, policy="full"),
    "hidden_loss+ac:long_context": Variant(hidden_loss=True, policy="long_context"),
    "all:long_context": Variant(packing=True, hidden_loss=True, policy="long_context"),
    **SFT_VARIANTS,
}
MOE_ONLY = frozenset({"ac:non_moe"})
DESCRIPTIONS = {
    "stock": "Transformers' own loss, padded batches, no checkpointing",
    "stock+hf_gc": "stock with TrainingArguments(gradient_checkpointing=True)",
    "hidden_loss": "model_patches.enable_linear_cross_entropy(model)",
    "hidden_loss+hf_gc": "enable_linear_cross_entropy(model) with TrainingArguments(gradient_checkpointing=True)",
    "ac:full": "ac_policies.apply_policy(model, 'full')",
    "ac:non_moe": "ac_policies.apply_policy(model, 'non_moe')",
    "ac:fit(0.5)": "ac_policies.fit(model, step, 0.5) on the first batch, then apply_policy",
    "packing": "enable_packing(model=model) + PackingCollator instead of padding",
    "hidden_loss+ac:full": "enable_linear_cross_entropy + apply_policy('full'), padded batches (all without packing)",
    "all": "packing + enable_linear_cross_entropy + apply_policy('full')",
    "hidden_loss+ac:long_context": "enable_linear_cross_entropy + apply_policy('long_context') (full + tiled MLPs and norms)",
    "all:long_context": "packing + enable_linear_cross_entropy + apply_policy('long_context')",
    **SFT_DESCRIPTIONS,
}
#: Relative tolerance of a step's loss against stock's, by the dtype the run trains in.
LOSS_TOLERANCE = {"fp32": 1e-4, "bf16": 2e-2, "fp16": 2e-2}


def variant_by_name(name: str) -> Variant:
    if name not in VARIANTS:
        raise ValueError(f"unknown train variant {name!r}; known: {', '.join(VARIANTS)}")
    return VARIANTS[name]


def variants_for(names: list[str], kind: str) -> list[str]:
    """``names`` that apply to a ``kind`` ("dense"/"moe") model, in order; the ``trl.SFTTrainer``
    variants only when TRL is installed (logged when they are left out)."""
    for n in names:
        variant_by_name(n)
    out = [n for n in names if kind == "moe" or n not in MOE_ONLY]
    if not trl_available():
        sft = [n for n in out if VARIANTS[n].trainer == "sft"]
        if sft:
            logger.warning("TRL is not installed: the SFTTrainer variants %s are left out", ", ".join(sft))
        out = [n for n in out if n not in sft]
    return out


def same_checkpointing(name: str, available: list[str]) -> Optional[str]:
    """The stock variant ``name``'s speed and memory are compared with, if it ran: the same trainer,
    no checkpointing against none, any checkpointing (Hugging Face's or a policy) against Hugging Face's."""
    v = variant_by_name(name)
    prefix = "stock" if v.trainer == "hf" else "sft"
    base = prefix if v.checkpointing == "none" else f"{prefix}+hf_gc"
    return base if base in available else None


def loss_reference(available: list[str]) -> Optional[str]:
    """The stock run whose losses every variant is checked against (checkpointing and the trainer
    do not change the loss): ``stock``, else ``stock+hf_gc``, else TRL's ``sft`` or ``sft+hf_gc``."""
    return next((n for n in ("stock", "stock+hf_gc", "sft", "sft+hf_gc") if n in available), None)


def loss_agreement(reference: list[float], losses: list[float], tol: float) -> tuple[float, bool]:
    """``(max |loss - reference| over the steps, whether every step is within tol * max(1, |ref|))``.

    Raises:
        ValueError: the two runs have different step counts.
    """
    if len(reference) != len(losses):
        raise ValueError(f"loss curves of different lengths: {len(reference)} and {len(losses)} steps")
    diffs = [abs(a - b) for a, b in zip(losses, reference)]
    ok = all(d <= tol * max(1.0, abs(r)) for d, r in zip(diffs, reference))
    return (max(diffs) if diffs else 0.0), ok


def run_variant(spec: dict[str, Any], timeout: float, cache: Optional[Path] = None) -> dict[str, Any]:
    """Run :mod:`bench.sections.train.worker` with ``spec`` in a fresh process; its result, or ``{"error": ...}``.

    With ``cache`` (a folder, ``--train-cache``), a result already stored there for the same spec is
    returned without running, and a new successful result is stored: an interrupted ``--full`` run
    resumes where it stopped. The key is the spec alone, so clear the folder after changing code.
    """
    stored = None
    if cache is not None:
        key = hashlib.sha1(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]
        stored = Path(cache) / f"{key}.json"
        if stored.exists():
            logger.info("train: reusing %s for %s", stored, spec.get("model"))
            return json.loads(stored.read_text())["result"]
    result = _run(spec, timeout)
    if stored is not None and "error" not in result:
        stored.parent.mkdir(parents=True, exist_ok=True)
        stored.write_text(json.dumps({"spec": spec, "result": result}))
    return result


def _run(spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    try:
        return isolated.call(worker.run, spec, timeout=timeout)
    except isolated.WorkerFailed as exc:
        return {"error": str(exc)[:300]}
