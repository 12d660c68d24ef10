"""The ``train`` section's longest-context table: stock against the library within a memory budget.

Per model, :func:`longest_context_table` searches (:func:`bench.sections.train.context.longest_fitting`:
doubling, then bisection, never extrapolated) the longest context (one row of one document) whose
measured step peak above the static state stays within ``--train-budget``, for stock with
Hugging Face checkpointing and for the library (hidden-state loss + the ``long_context`` policy). Each
probe is a training run in its own process: a warm-up step of :data:`WARMUP_TOKENS` tokens (it
creates AdamW's state and whatever a first call keeps), then one measured step at the probed
length, so a probe costs about one step at that length.

Then both at stock's longest context, side by side: the library's peak above static against
stock's, and what holds each peak, per phase.

Targets (the issue's): the library's longest context >= :data:`TARGET_CONTEXT_RATIO` x stock's;
at stock's longest context, the library's peak above static <= :data:`TARGET_PEAK_RATIO` x stock's.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable, Optional

from bench.harness.report import Table, ratio
from bench.sections.train.context import Budget, Search, longest_fitting, parse_budget
from bench.sections.train.meter import MIB, phase_peaks, what_holds
from bench.sections.train.variant import Variant
from bench.sections.train.variant_table import run_variant

#: The pair the search compares: stock with Hugging Face checkpointing, and the library.
CONTEXT_PAIR = {"stock+hf_gc": Variant(hf_gc=True), "library": Variant(hidden_loss=True, policy="long_context")}
#: Tokens of each probe's warm-up step (its first), the measured step being the second.
WARMUP_TOKENS = 64
#: The search's first length and its step.
START_TOKENS = 128
GRANULARITY = 64
#: The default budget on top of the static state, and the longest context probed. At Qwen3-0.6B's
#: widths (1 layer, fp32, 2-core CPU) stock+hf_gc's step peak is a flat 1197 MiB above static up to
#: about 1000 tokens (the tied embedding's gradient: two [V, H] fp32 buffers of 593 MiB beside the
#: one counted as static), then grows by about 1.34 MiB a token ([T, V] fp32 logits, log-softmax
#: and their gradients); the library's is near 605 MiB (one such buffer) up to 2048 tokens, then
#: grows by about 0.09 MiB a token (the recomputed layer). Within +1.5GiB stock fits 1024 tokens on
#: its flat floor, where the library's peak is 0.51x stock's (two buffers against one); within
#: +2GiB stock's longest (1280) is set by its per-token memory, as at long context, and the
#: library reaches the 8192 limit (a 2-core CPU probes it in about two minutes; the whole
#: search takes about 7).
DEFAULT_BUDGET = "+2GiB"
DEFAULT_LIMIT = 8192
TARGET_CONTEXT_RATIO = 4.0
TARGET_PEAK_RATIO = 0.5

SpecFor = Callable[[Variant, dict[str, Any]], dict[str, Any]]


def _mib(n: Optional[float]) -> Optional[float]:
    return None if n is None else n / MIB


def met(value: Optional[float], target: float, at_least: bool, lower_bound: bool = False) -> str:
    """``"met (5.00x; target >= 4x)"``; ``lower_bound``: ``value`` is a lower bound (a search limit)."""
    if value is None:
        return "not measured"
    ok = value >= target if at_least else value <= target
    return (f"{'met' if ok else 'NOT met'} ({value:.2f}x{' or more' if lower_bound else ''}; "
            f"target {'>=' if at_least else '<='} {target:g}x)")


def longest_context_table(args: argparse.Namespace, model: str, layers: int, spec_for: SpecFor, command: str,
                          tick: Callable[[str], None]) -> tuple[Table, dict[str, Any]]:
    """Search both of :data:`CONTEXT_PAIR` within ``args.train_budget`` up to ``args.train_context_limit``.

    ``spec_for(variant, data)`` is the worker spec of one run of ``model`` with ``layers`` layers;
    ``command`` reproduces the table. Returns the table and every probe's figures.
    """
    budget: Budget = parse_budget(args.train_budget)
    limit = int(args.train_context_limit)
    probes: dict[tuple[str, int], dict[str, Any]] = {}

    def probe(name: str, tokens: int) -> dict[str, Any]:
        if (name, tokens) not in probes:
            tick(f"train context {model} {name} {tokens}")
            data = {"steps": 2, "context": tokens, "warmup": min(WARMUP_TOKENS, tokens)}
            probes[(name, tokens)] = run_variant(spec_for(CONTEXT_PAIR[name], data), args.train_timeout,
                                                 getattr(args, "train_cache", None))
        return probes[(name, tokens)]

    def fits(name: str, tokens: int) -> bool:
        r = probe(name, tokens)
        if "error" in r:
            return False
        return r["peak_above_static"] <= budget.limit_above_static(sum(r["static"].values()))

    start = min(START_TOKENS, limit)
    searches: dict[str, Search] = {n: longest_fitting(lambda t, n=n: fits(n, t), start, limit, GRANULARITY)
                                   for n in CONTEXT_PAIR}
    stock_longest = searches["stock+hf_gc"].longest
    rows = []
    for name, s in searches.items():
        at = probes.get((name, s.longest)) if s.longest else {}
        rows.append([model, name, s.describe(), ratio(s.longest, stock_longest),
                     _mib(at.get("peak_above_static")), at.get("peak_phase"), phase_peaks(at), what_holds(at),
                     ", ".join(f"{t}:{'fits' if ok else 'no'}" + (" (error)" if "error" in probes[(name, t)] else "")
                               for t, ok in s.probes)])
    peak_ratio = None
    if stock_longest:
        s, lib = probe("stock+hf_gc", stock_longest), probe("library", stock_longest)
        if "error" not in s and "error" not in lib:
            peak_ratio = ratio(lib["peak_above_static"], s["peak_above_static"])
            for name, r in (("stock+hf_gc", s), ("library", lib)):
                rows.append([model, f"{name} at stock's longest ({stock_longest})", None,
                             ratio(r["peak_above_static"], s["peak_above_static"]), _mib(r["peak_above_static"]),
                             r["peak_phase"], phase_peaks(r), what_holds(r), None])
    lib_search = searches["library"]
    context_ratio = ratio(lib_search.longest, stock_longest)
    static_total = next((sum(r["static"].values()) for r in probes.values() if "static" in r), None)
    notes = [
        "library: enable_linear_cross_entropy + apply_policy('long_context'); stock+hf_gc: Transformers' own loss with "
        "TrainingArguments(gradient_checkpointing=True)",
        f"each probe its own process: one row of one document, a warm-up step of {WARMUP_TOKENS} tokens, then one "
        "measured step at the probed length; a probe that exceeds the budget, fails or times out does not fit",
        f"search: doubling from {start}, then bisection on multiples of {GRANULARITY} until the bounds are within a "
        f"quarter of the fit; limit {limit} tokens (measured, never extrapolated; '>= limit' when the limit fits)",
        "x stock: the longest context against stock's; in the rows at stock's longest, the peak above static against "
        "stock's at that length",
        "target: the library's longest context >= 4x stock's: "
        + met(context_ratio, TARGET_CONTEXT_RATIO, True, lower_bound=lib_search.at_limit),
        "target: at stock's longest, the library's peak above static <= 0.5x stock's: "
        + met(peak_ratio, TARGET_PEAK_RATIO, False),
    ]
    table = Table(
        title=f"train: longest context within {budget.describe(static_total)}, {model}, {layers} layer"
              f"{'s' if layers != 1 else ''}",
        columns=["model", "variant", "longest context (tokens)", "x stock", "peak above static (MiB)", "peak phase",
                 "fwd / bwd / opt peak above step start (MiB)", "what holds the peak", "probes (tokens: fits)"],
        rows=rows, command=command, keys=2, baseline="stock+hf_gc", notes=notes,
    )
    data = {"budget": args.train_budget, "limit": limit, "context_ratio": context_ratio,
            "peak_ratio_at_stock_longest": peak_ratio,
            "searches": {n: {"longest": s.longest, "probes": s.probes, "at_limit": s.at_limit}
                         for n, s in searches.items()},
            "probes": {f"{n}/{t}": r for (n, t), r in probes.items()}}
    return table, data
