"""The ``train`` section's comparisons: each feature's ratio against the run that differs from it in
that feature alone, so that every ratio says what one change buys.

A :class:`Comparison` names a variant and the baseline it is measured against; both ran in the same
section run, each in its own process, on the same documents and weights. Ratios: real tokens per
second (padding not counted) and the step's peak above the static state. Targets are the issue's:
the library's real tokens/s >= 1.0x stock's with the same checkpointing, packed >= 1.3x padded on
the section's document distribution.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from bench.harness.report import Table, ratio
from bench.sections.train.longest import met


@dataclasses.dataclass(frozen=True)
class Comparison:
    """``variant`` against ``baseline``; ``isolates``: the one thing that differs between them."""

    name: str
    variant: str
    baseline: str
    isolates: str
    #: minimum real tokens/s ratio (the issue's target), or None when the row is informative only
    target: Optional[float] = None


COMPARISONS = (
    Comparison("hidden-state loss", "hidden_loss", "stock", "the loss (no checkpointing in either)", 1.0),
    Comparison("hidden-state loss, HF checkpointing", "hidden_loss+hf_gc", "stock+hf_gc",
               "the loss (Hugging Face checkpointing in both)", 1.0),
    Comparison("policy 'full' vs HF checkpointing", "ac:full", "stock+hf_gc", "the checkpointing (stock loss)"),
    Comparison("packing, Transformers' loss", "packing", "stock", "packed vs padded rows (stock loss, no checkpointing)",
               1.3),
    Comparison("packing, library loss and policy", "all", "hidden_loss+ac:full",
               "packed vs padded rows (hidden-state loss + policy 'full' in both)", 1.3),
    Comparison("everything", "all", "stock+hf_gc", "the library (packing, loss, policy) vs stock with checkpointing",
               1.0),
    Comparison("SFTTrainer: hidden-state loss", "sft:hidden_loss", "sft",
               "TRL's head on functional_ce vs TRL's kernel (TRL's padding)", 1.0),
    Comparison("SFTTrainer: packing", "sft:packing", "sft",
               "PackingCollator vs TRL's padding collator (TRL's kernel)", 1.3),
    Comparison("SFTTrainer: everything", "sft:all", "sft+hf_gc",
               "the library vs SFTTrainer's defaults (gradient_checkpointing=True)", 1.0),
)


def comparison_table(model: str, results: dict[str, dict[str, Any]], agree: dict[str, Optional[bool]],
                     command: str) -> Optional[Table]:
    """The rows of :data:`COMPARISONS` whose two variants both ran without error (None if none did).

    ``results``: variant name -> its worker figures; ``agree``: variant name -> whether its losses
    agree with the reference run's.
    """
    ok = {n for n, r in results.items() if "error" not in r}
    rows = []
    for c in COMPARISONS:
        if c.variant not in ok or c.baseline not in ok:
            continue
        v, b = results[c.variant], results[c.baseline]
        speed = ratio(v["tokens_per_s"], b["tokens_per_s"])
        both = [agree.get(c.variant), agree.get(c.baseline)]
        rows.append([c.name, c.variant, c.baseline, v["tokens_per_s"], b["tokens_per_s"], speed,
                     ratio(v["peak_above_static"], b["peak_above_static"]),
                     "-" if None in both else ("yes" if all(both) else "NO"),
                     "-" if c.target is None else met(speed, c.target, True), c.isolates])
    if not rows:
        return None
    return Table(
        title=f"train: {model}, what each change buys (one change per row)",
        columns=["comparison", "variant", "against", "real tokens/s", "baseline real tokens/s", "x (tokens/s)",
                 "x (peak above static)", "losses agree (both)", "target (tokens/s)", "what differs"],
        rows=rows, command=command, baseline="the 'against' column, run in the same section run",
        notes=["each pair differs in the one thing named; both ran in their own processes on the same documents, "
               "weights and seed; figures from the variants table above",
               "targets: the library's real tokens/s >= 1.0x stock's with the same checkpointing; packed >= 1.3x "
               "padded on the section's document distribution (the packing gain depends on documents per step "
               "and row length: see the documents note above)"],
    )
