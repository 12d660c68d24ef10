"""``packing`` section: does a packed row equal its documents run alone, stock vs patched, and
how full does ``PackingCollator`` fill its rows.

Table 1 (installed Transformers): for each model family x attention backend, the max
|packed logits - each document alone| (fp32) with stock Transformers and with
``enable_packing()``, on the same batch (3 rows of 12 tokens, 7 documents, padding).
Table 2 (``bench.sections.packing.families``): per family, stock gap, then covered, made correct or refused
(and why) under ``enable_packing(model=...)`` and plain ``enable_packing()``.
Table 3 (``bench.sections.packing.step``): compiled training-step time of a packed batch, stock vs
``enable_packing`` (two inductor compiles per model: in ``--full`` runs or with ``--packing-step on``).
Table 4: tokens / row slots of ``PackingCollator`` on a long-tailed (log-normal) length
distribution, next to padding every document to ``max_length`` and to next-fit packing in
arrival order.

The quick run measures tables 1, 2 (the families of :data:`QUICK_SWEEP`) and 4; ``--full`` every
family of ``bench.sections.packing.families.DEFAULT_SWEEP`` and table 3. The section's flags override either.
"""

from __future__ import annotations

import argparse
import logging
import math
import random
import shlex
import time
from typing import Any, Callable

from bench.harness.modes import override, pick
from bench.harness.report import Section, Table
from bench.sections.packing.families import DEFAULT_SWEEP, family_table
from bench.sections.packing.step import step_table

DEFAULT_FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "gemma3", "qwen3_moe"]
DEFAULT_BACKENDS = ["eager", "sdpa", "flash_attention_2", "flex_attention"]


def add_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--packing-families", nargs="+", default=DEFAULT_FAMILIES, metavar="FAMILY")
    group.add_argument("--packing-backends", nargs="+", default=DEFAULT_BACKENDS, metavar="BACKEND")
    group.add_argument(
        "--packing-flex", choices=["first", "all"], default="first",
        help="flex_attention for the first family only (default; each family costs a CPU compile) or all",
    )
    group.add_argument("--packing-docs", type=int, default=4000, help="documents drawn for the collator table")
    group.add_argument(
        "--packing-sweep", nargs="+", metavar="FAMILY",
        help="families of the per-family outcome table ('all': every AutoModelForCausalLM family; "
        "'none': skip; 'falcon+alibi' sets alibi=True; default: one per mixer kind, --full: 30)",
    )
    group.add_argument("--packing-step", choices=["on", "off"],
                       help="the compiled step-time table (two inductor compiles, a few minutes on CPU; "
                            "default off, --full on)")
    group.add_argument("--packing-step-backend", default="inductor")
    group.add_argument("--packing-step-repeats", type=int, default=5)
    group.add_argument("--packing-step-models", nargs="+", default=["llama", "qwen3_next"],
                       choices=["llama", "qwen3_next"], help="models of the compiled-step table")
    group.add_argument("--packing-max-length", type=int, default=4096)


def _command(args: argparse.Namespace) -> str:
    """The command that reproduces the section as this run resolved it."""
    flags = ["--packing-families", *args.packing_families, "--packing-backends", *args.packing_backends,
             "--packing-flex", args.packing_flex, "--packing-sweep", *args.packing_sweep,
             "--packing-step", args.packing_step]
    return "python -m bench --only packing " + " ".join(shlex.quote(a) for a in flags)


def _leak_table(args: argparse.Namespace, tick: Callable[[str], None]) -> tuple[Table, dict[str, Any]]:
    import transformers

    from model_patches import enable_packing
    from model_patches.testing.packing_oracle import logits_gap, packed_batch, tiny_model

    batch = packed_batch()
    columns = ["family"]
    for b in args.packing_backends:
        columns += [f"{b} stock", f"{b} patched"]
    rows, data = [], {}
    for i, family in enumerate(args.packing_families):
        model = tiny_model(family)
        row: list[Any] = [family]
        for backend in args.packing_backends:
            if backend == "flex_attention" and args.packing_flex == "first" and i > 0:
                row += [None, None]
                continue
            tick(f"packing {family} {backend}")
            stock = logits_gap(model, batch, backend)
            with enable_packing():
                patched = max(logits_gap(model, batch, backend, use_cache=c) for c in (False, True))
            row += [stock, patched]
            data[f"{family}/{backend}"] = {"stock": stock, "patched": patched}
        rows.append(row)
    worst = max((v["patched"] for v in data.values()), default=float("nan"))
    notes = [
        f"transformers {transformers.__version__}; tiny random-init fp32 models (hidden 64, 2 layers); "
        "batch of 3 rows x 12 tokens holding 7 documents and 6 pads; per-document truth = each "
        "document alone under eager attention without a mask",
        f"worst patched gap {worst:.2e} (target <= 1e-4); patched = max over use_cache off/on",
        "flash_attention_2 on CPU runs Transformers' real flash path with kernels routed to "
        "per-sequence SDPA (model_patches.testing)",
    ]
    if args.packing_flex == "first" and "flex_attention" in args.packing_backends:
        notes.append("flex_attention for the first family only (CPU compile per family); --packing-flex all for every family")
    table = Table(
        title="packed vs per-document logits, max |diff| (fp32)",
        columns=columns, rows=rows, command=_command(args), baseline="stock Transformers (same batch, same run)",
        notes=notes,
    )
    return table, data


def _lengths(n: int, max_length: int, seed: int = 0) -> list[int]:
    """Log-normal lengths: median 256 tokens, sigma 1.2 (long tail), clipped to 1..max_length."""
    rng = random.Random(seed)
    return [min(max_length, max(1, int(rng.lognormvariate(math.log(256), 1.2)))) for _ in range(n)]


def _next_fit_rows(lengths: list[int], max_length: int) -> int:
    rows, room = 0, 0
    for n in lengths:
        if n > room:
            rows, room = rows + 1, max_length
        room -= n
    return rows


def _efficiency_table(args: argparse.Namespace, tick: Callable[[str], None]) -> tuple[Table, dict[str, Any]]:
    from model_patches import PackingCollator

    L = args.packing_max_length
    lengths = _lengths(args.packing_docs, L)
    total = sum(lengths)
    rows, data = [], {}
    rows.append(["pad every document to max_length", len(lengths), total / (len(lengths) * L), None])
    rows.append(["next fit, arrival order", len(lengths), total / (_next_fit_rows(lengths, L) * L), None])
    collator = PackingCollator(L, require_packing=False, return_num_tokens=True)  # no model sees these batches
    rng = random.Random(1)
    for pool in (64, 512, len(lengths)):
        tick(f"packing collator pool {pool}")
        tokens = slots = 0
        t0 = time.perf_counter()
        for s in range(0, len(lengths), pool):
            docs = [[rng.randrange(1, 1000)] * n for n in lengths[s : s + pool]]
            batch = collator(docs)
            tokens += int(batch["num_tokens"].sum())
            slots += batch["attention_mask"].numel()
        seconds = time.perf_counter() - t0
        rows.append([f"PackingCollator, {pool} documents per call", pool, tokens / slots, seconds])
        data[f"pool_{pool}"] = {"efficiency": tokens / slots, "seconds": seconds}
    table = Table(
        title=f"packing efficiency (real tokens / row slots), max_length {L}",
        columns=["method", "documents per call", "efficiency", "collate time (s)"],
        rows=rows,
        command=_command(args),
        baseline="pad every document to max_length",
        notes=[
            f"{len(lengths)} documents, log-normal lengths (median 256, sigma 1.2), clipped to 1..{L}; "
            f"mean {total / len(lengths):.0f}, max {max(lengths)} tokens; target >= 0.95",
        ],
    )
    return table, data


#: The quick run's per-family table: one family of each kind of sequence mixer (attention, an
#: MoE router, ALiBi, a hybrid with recurrent layers, a pure state-space model).
QUICK_SWEEP = ["llama", "qwen3_moe", "falcon+alibi", "jamba", "mamba2"]


def _resolved(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with the quick or full defaults of the flags the user left unset."""
    return override(args, packing_sweep=pick(args, args.packing_sweep, QUICK_SWEEP, DEFAULT_SWEEP),
                    packing_step=pick(args, args.packing_step, "off", "on"))


def count(args: argparse.Namespace) -> int:
    """Progress steps: family x backend, the sweep's families, the compiled steps, the collator pools."""
    a = _resolved(args)
    leak = sum(len(a.packing_backends) - (i > 0 and a.packing_flex == "first" and "flex_attention" in a.packing_backends)
               for i in range(len(a.packing_families)))
    sweep = 0 if a.packing_sweep == ["none"] else len(a.packing_sweep)
    return leak + sweep + (2 * len(a.packing_step_models) if a.packing_step == "on" else 0) + 3


def run(args: argparse.Namespace, tick: Callable[[str], None]) -> Section:
    args = _resolved(args)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    leak, leak_data = _leak_table(args, tick)
    tables, data = [leak], {"leak": leak_data}
    if args.packing_sweep != ["none"]:
        families, data["families"] = family_table(args, _command(args), tick)
        tables.append(families)
    if args.packing_step == "on":
        step, data["step"] = step_table(args, _command(args), tick)
        tables.append(step)
    eff, data["efficiency"] = _efficiency_table(args, tick)
    tables.append(eff)
    return Section(name="packing", tables=tables, data=data)
