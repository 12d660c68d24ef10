"""The ``train`` section's variants, how each is run (its own process) and how its figures are judged.

A variant (:class:`bench.train_worker.Variant`) is stock Transformers or stock plus one or more
of the library's features. Each runs in a fresh process (:func:`run_variant`) on the same data,
from the same initial weights and seed. Judging:

- losses (:func:`loss_agreement`): every step's loss against stock's, ``|diff| <= tol *
  max(1, |stock|)`` with ``tol`` by dtype (:data:`LOSS_TOLERANCE`); a packed variant is compared
  with padded stock as the same per-token mean over the same documents;
- speed and memory against stock *with the same checkpointing* (:func:`same_checkpointing`):
  no checkpointing against ``stock``, any checkpointing (Hugging Face's or a policy) against
  ``stock+hf_gc``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any, Optional

from .measure import child_env
from .train_worker import MARK, Variant

#: name -> what it changes against stock. ``ac:non_moe`` runs on MoE models only.
VARIANTS: dict[str, Variant] = {
    "stock": Variant(),
    "stock+hf_gc": Variant(hf_gc=True),
    "hidden_loss": Variant(hidden_loss=True),
    "ac:full": Variant(policy="full"),
    "ac:non_moe": Variant(policy="non_moe"),
    "ac:fit(0.5)": Variant(fit=0.5),
    "packing": Variant(packing=True),
    "all": Variant(packing=True, hidden_loss=True, policy="full"),
}
MOE_ONLY = frozenset({"ac:non_moe"})
DESCRIPTIONS = {
    "stock": "Transformers' own loss, padded batches, no checkpointing",
    "stock+hf_gc": "stock with TrainingArguments(gradient_checkpointing=True)",
    "hidden_loss": "model_patches.enable_hidden_state_loss(model)",
    "ac:full": "ac_policies.apply_policy(model, 'full')",
    "ac:non_moe": "ac_policies.apply_policy(model, 'non_moe')",
    "ac:fit(0.5)": "ac_policies.fit(model, step, 0.5) on the first batch, then apply_policy",
    "packing": "enable_packing(model=model) + PackingCollator instead of padding",
    "all": "packing + enable_hidden_state_loss + apply_policy('full')",
}
#: Relative tolerance of a step's loss against stock's, by the dtype the run trains in.
LOSS_TOLERANCE = {"fp32": 1e-4, "bf16": 2e-2, "fp16": 2e-2}


def variant_by_name(name: str) -> Variant:
    if name not in VARIANTS:
        raise ValueError(f"unknown train variant {name!r}; known: {', '.join(VARIANTS)}")
    return VARIANTS[name]


def variants_for(names: list[str], kind: str) -> list[str]:
    """``names`` that apply to a ``kind`` ("dense"/"moe") model, in order."""
    for n in names:
        variant_by_name(n)
    return [n for n in names if kind == "moe" or n not in MOE_ONLY]


def same_checkpointing(name: str, available: list[str]) -> Optional[str]:
    """The stock variant ``name``'s speed and memory are compared with, if it ran."""
    base = "stock" if variant_by_name(name).checkpointing == "none" else "stock+hf_gc"
    return base if base in available else None


def loss_reference(available: list[str]) -> Optional[str]:
    """The stock run whose losses every variant is checked against (checkpointing does not
    change the loss): ``stock``, else ``stock+hf_gc``."""
    return next((n for n in ("stock", "stock+hf_gc") if n in available), None)


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


def run_variant(spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Run :mod:`bench.train_worker` with ``spec`` in a fresh process; its result, or ``{"error": ...}``."""
    try:
        proc = subprocess.run([sys.executable, "-m", "bench.train_worker", json.dumps(spec)], capture_output=True,
                              text=True, timeout=timeout, env=child_env())
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    if proc.returncode < 0:
        return {"error": f"killed by signal {-proc.returncode} (out of memory?)"}
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [f"exit code {proc.returncode}"]
    return {"error": tail[0][:300]}
