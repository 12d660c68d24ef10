"""The ``train`` section's headline table: stock with Hugging Face checkpointing against the library at
one sequence length, at the depth given (the README's rows: Qwen3-0.6B at its published 28 layers).

Each variant trains in its own process on one row of one document of ``tokens`` tokens per step
(the context probes' data, :func:`bench.sections.train.data.context_documents`): a warm-up step of
:data:`WARMUP_TOKENS` tokens, then ``steps - 1`` measured steps at the length. Columns: tokens/s,
peak above the static state (parameters, gradients, AdamW state) and the losses of every step
against stock's.
"""

from __future__ import annotations

from typing import Any, Callable

from bench.harness.report import Table, ratio
from bench.sections.train.longest import CONTEXT_PAIR
from bench.sections.train.meter import MIB, what_holds
from bench.sections.train.variant import Variant
from bench.sections.train.variant_table import LOSS_TOLERANCE, loss_agreement, run_variant

WARMUP_TOKENS = 64

SpecFor = Callable[[Variant, dict[str, Any]], dict[str, Any]]


def headline_table(model: str, layers: int, tokens: int, steps: int, dtype: str, spec_for: SpecFor, command: str,
                   timeout: float, tick: Callable[[str], None], cache: Any = None) -> tuple[Table, dict[str, Any]]:
    """Both of :data:`bench.sections.train.longest.CONTEXT_PAIR` at ``tokens`` tokens, ``steps`` steps."""
    data = {"steps": steps, "context": tokens, "warmup": min(WARMUP_TOKENS, tokens)}
    results = {}
    for name, variant in CONTEXT_PAIR.items():
        tick(f"train headline {model} {name} {tokens}")
        results[name] = run_variant(spec_for(variant, data), timeout, cache)
    stock = results["stock+hf_gc"]
    rows = []
    for name, r in results.items():
        if "error" in r:
            rows.append([name, *[None] * 7, r["error"]])
            continue
        diff, agree = loss_agreement(stock["losses"], r["losses"], LOSS_TOLERANCE[dtype]) if "error" not in stock \
            else (None, None)
        rows.append([name, r["tokens_per_s"], ratio(r["tokens_per_s"], stock.get("tokens_per_s")),
                     r["peak_above_static"] / MIB, ratio(r["peak_above_static"], stock.get("peak_above_static")),
                     diff, None if agree is None else ("yes" if agree else "NO"), what_holds(r), "ok"])
    static = next((r["static"] for r in results.values() if "static" in r), None)
    notes = [
        f"{model}, {layers} layers, {dtype}; one row of one document of {tokens} tokens per step; {steps} steps, the "
        f"first a warm-up of {WARMUP_TOKENS} tokens (optimizer state, first calls): tokens/s and the peak come from "
        "the others",
        "library: enable_linear_cross_entropy + apply_policy('long_context'); stock+hf_gc: Transformers' own loss "
        "with TrainingArguments(gradient_checkpointing=True); Trainer's default optimizer",
        "peak above static: the step's peak minus parameters, gradients and AdamW state (the gradients, freed each "
        "step, count in it)",
    ]
    if static:
        notes.append(f"static state: parameters {static['params'] / MIB:.0f} MiB, gradients {static['grads'] / MIB:.0f} "
                     f"MiB, AdamW state {static['optimizer'] / MIB:.0f} MiB")
    table = Table(title=f"train: {model}, {layers} layers, one row of {tokens} tokens, stock vs library",
                  columns=["variant", "tokens/s", "x stock (tokens/s)", "peak above static (MiB)", "x stock (peak)",
                           "loss max |diff| vs stock", "losses agree", "what holds the peak", "status"],
                  rows=rows, command=command, baseline="stock+hf_gc", notes=notes)
    return table, results
