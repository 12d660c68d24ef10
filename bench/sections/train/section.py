"""``train`` section: whole training runs of real architectures, stock against the library.

Per model (:mod:`bench.sections.train.models`: published widths, random weights, fewer layers here), a
Hugging Face ``Trainer`` run per variant (:mod:`bench.sections.train.variant_table`), and with TRL installed the
same through ``trl.SFTTrainer`` (:mod:`bench.sections.train.sft`), each in its own process, on the same
documents (:mod:`bench.sections.train.data`), from the same weights, with the same seed. Tables:

1. per model, the variants: per-step losses against stock's (and whether they agree), real
   tokens per second (padding not counted) and the step's peak memory above the static state
   (parameters, gradients, AdamW state), both against stock with the same checkpointing and
   trainer, the phase where the peak happens (forward+loss, backward, optimizer step) and what
   holds it;
2. per model, what each change buys (:mod:`bench.sections.train.compare`): each feature against the run
   that differs from it in that feature alone (hidden-state loss vs stock with the same
   checkpointing, packed vs padded with the same loss, everything vs stock), with the targets;
3. per model, the losses step by step;
4. the longest context (one row, one document) whose measured step peak stays within
   ``--train-budget``, stock with Hugging Face checkpointing against the library (hidden-state
   loss + the ``long_context`` policy), each probe its own process (:mod:`bench.sections.train.longest`), and the
   two peaks at the longest context stock fits.

The quick run: Qwen3-0.6B's widths with 1 layer, 3 steps of 2 documents, three variants (stock
with Hugging Face checkpointing, the hidden-state loss alone with the same checkpointing,
everything on), under a minute on 2 cores; packing alone and the SFTTrainer rows are left to
``--full`` (two documents per step in rows of 128 pack into about as many slots as padding, so a
packing ratio there says nothing), and so is the context search (``--train-context on``: about 8
minutes). ``--full`` or ``--train-full``: the four models, 5 steps of 4 documents in rows of 256, and
the context search; every variant (SFTTrainer ones on ``--train-sft-models``) on the models of
``--train-every-variant-on`` (Qwen3-0.6B), :data:`CORE_VARIANTS` on the others (about an hour here).
"""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path
from typing import Any, Callable, Optional

from bench.harness.host_dtype import DtypeChoice, choose
from bench.harness.modes import is_full, override, pick
from bench.harness.report import Section, Table, ratio
from bench.sections.train.compare import comparison_table
from bench.sections.train.data import DISTRIBUTION
from bench.sections.train.headline import headline_table
from bench.sections.train.longest import DEFAULT_BUDGET, DEFAULT_LIMIT, longest_context_table
from bench.sections.train.meter import phase_peaks, what_holds
from bench.sections.train.models import FULL_MODELS, QUICK_MODELS, model_entry
from bench.sections.train.planned import planned_context_table, plans, projection_searches, projection_table
from bench.sections.train.variant_table import (
    DESCRIPTIONS,
    LOSS_TOLERANCE,
    VARIANTS,
    Variant,
    loss_agreement,
    loss_reference,
    run_variant,
    same_checkpointing,
    variants_for,
)

MIB = 2**20
#: The quick run's variants: stock with Hugging Face checkpointing and everything on (each feature alone
#: runs in --full); two processes of 3 steps, about half a minute on 2 cores.
QUICK_VARIANTS = ["stock+hf_gc", "all"]
QUICK_STEPS = 3
#: Models the trl.SFTTrainer variants run on by default (each SFTTrainer run costs what a Trainer run does).
SFT_MODELS = ["qwen3-0.6b"]
#: Models that run every variant in --full; the others run :data:`CORE_VARIANTS` (every variant on every
#: model is about two hours on 2 cores: ``--train-every-variant-on`` names more).
EVERY_VARIANT_MODELS = ["qwen3-0.6b"]
#: What the other models run in --full: stock and the hidden-state loss with the same checkpointing,
#: everything on, and on a MoE model the ``non_moe`` preset.
CORE_VARIANTS = ["stock+hf_gc", "hidden_loss+hf_gc", "ac:non_moe", "all"]
FULL_STEPS = 5
#: Decoder layers in the --full run: as many as this 24 GB, 2-core host runs in reasonable time.
FULL_LAYERS = {"qwen3-0.6b": 2, "mistral-7b": 1, "llama3.1-8b": 1, "qwen3-30b-a3b": 2, "gemma2-2b": 1}


def add_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--train-full", action="store_true", help="this section as --full runs it")
    group.add_argument("--train-models", nargs="*", metavar="MODEL",
                       help=f"models (default {' '.join(QUICK_MODELS)}; --full: {' '.join(FULL_MODELS)}; none: no model tables)")
    group.add_argument("--train-variants", nargs="+", metavar="VARIANT",
                       help=f"variants of {', '.join(VARIANTS)} (default {' '.join(QUICK_VARIANTS)}; --full: all; "
                            "the sft ones need TRL)")
    group.add_argument("--train-sft-models", nargs="+", metavar="MODEL",
                       help=f"models the SFTTrainer variants run on (default {' '.join(SFT_MODELS)})")
    group.add_argument("--train-every-variant-on", nargs="+", metavar="MODEL",
                       help=f"--full: models that run every variant (default {' '.join(EVERY_VARIANT_MODELS)}); "
                            f"the others run {' '.join(CORE_VARIANTS)} (the MoE preset on MoE models only)")
    group.add_argument("--train-layers", type=int, help="decoder layers of every model (default 1; --full: per model)")
    group.add_argument("--train-steps", type=int,
                       help=f"optimizer steps, the first a warm-up (default {QUICK_STEPS}; --full {FULL_STEPS})")
    group.add_argument("--train-docs", type=int, help="documents per step (default 2; --full 4)")
    group.add_argument("--train-row", type=int, help="tokens per packed row, longest document (default 128; --full 256)")
    group.add_argument("--train-lr", type=float, default=1e-4, help="learning rate (constant; default 1e-4)")
    group.add_argument("--train-context", choices=["on", "off"], help="the longest-context search (default off; --full on)")
    group.add_argument("--train-context-models", nargs="+", metavar="MODEL",
                       help="models of the context search (default qwen3-0.6b)")
    group.add_argument("--train-budget",
                       help=f"memory budget of the context search: '{DEFAULT_BUDGET}' on top of the static state "
                            "(parameters, gradients, optimizer state; default), or '6GiB' in all")
    group.add_argument("--train-context-limit", type=int, help=f"longest context probed (default {DEFAULT_LIMIT})")
    group.add_argument("--train-headline", type=int, metavar="TOKENS",
                       help="also run stock+hf_gc and the library on one row of TOKENS tokens (the README's headline "
                            "rows; with --train-layers 28 for Qwen3-0.6B's published depth)")
    group.add_argument("--train-planned", choices=["on", "off"],
                       help="the longest context planned by ac_policies.longest_context at full depth, checked by "
                            "measured steps (default off; --full on)")
    group.add_argument("--train-planned-layers", type=int,
                       help="decoder layers of the planned-context model (default: the published depth)")
    group.add_argument("--train-projection", choices=["on", "off"],
                       help="the estimated longest context of Llama-3.1-8B and Qwen3-30B-A3B on 80 GiB devices "
                            "(default off; --full on)")
    group.add_argument("--train-timeout", type=float, default=1800.0, help="seconds before a run counts as failed")
    group.add_argument("--train-cache", type=Path, metavar="DIR",
                       help="keep each run's result in DIR and reuse those already there for the same settings "
                            "(resume an interrupted --full run; clear DIR after changing code)")
    group.add_argument("--train-dtype", choices=["bf16", "fp16", "fp32"],
                       help="fp32 weights and AdamW; bf16: Trainer(bf16=True) autocast (default: by host)")
    group.add_argument("--train-overrides", help="JSON config values over every model (tiny widths for tests)")


def resolved(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with the quick or full defaults of the flags left unset."""
    full = is_full(args) or bool(getattr(args, "train_full", False))
    a = override(args, full=full)
    g = lambda name: getattr(args, name, None)  # noqa: E731
    return override(
        a, train_models=pick(a, g("train_models"), QUICK_MODELS, FULL_MODELS),
        train_variants=pick(a, g("train_variants"), QUICK_VARIANTS, list(VARIANTS)),
        train_steps=pick(a, g("train_steps"), QUICK_STEPS, FULL_STEPS),
        train_every_variant_on=g("train_every_variant_on") or EVERY_VARIANT_MODELS,
        train_variants_given=bool(g("train_variants")), train_full_run=full, train_sft_models=g("train_sft_models") or SFT_MODELS, train_docs=pick(a, g("train_docs"), 2, 4),
        train_row=pick(a, g("train_row"), 128, 256), train_context=pick(a, g("train_context"), "off", "on"),
        train_context_models=g("train_context_models") or ["qwen3-0.6b"],
        train_planned=pick(a, g("train_planned"), "off", "on"), train_projection=pick(a, g("train_projection"), "off", "on"),
        train_planned_layers=g("train_planned_layers"),
        train_context_limit=g("train_context_limit") or DEFAULT_LIMIT, train_lr=g("train_lr") or 1e-4,
        train_budget=g("train_budget") or DEFAULT_BUDGET, train_timeout=g("train_timeout") or 1800.0,
        full=is_full(args),
    ), full


def _layers(args: argparse.Namespace, model: str, full: bool) -> int:
    if args.train_layers:
        return args.train_layers
    return FULL_LAYERS.get(model, 1) if full else 1


#: The CPU default: the issue's loss agreement is stated within fp32 round-off, and a CPU run is
#: about memory and agreement first (bf16 autocast: --train-dtype bf16).
CPU_DTYPE = DtypeChoice("fp32", "fp32 weights, activations, losses and AdamW on CPU, so that variants agree within "
                                "fp32 round-off; --train-dtype bf16 for Trainer(bf16=True) autocast")


def dtypes(args: argparse.Namespace) -> dict[str, DtypeChoice]:
    """fp32 on CPU (:data:`CPU_DTYPE`); on CUDA bf16 autocast over fp32 weights (``Trainer(bf16=True)``)."""
    on_cpu = str(getattr(args, "device", "cpu")).startswith("cpu")
    return {"train": choose(args, "--train-dtype", fixed=CPU_DTYPE if on_cpu else None)}


COLUMNS = ["variant", "checkpointing", "loss max |diff| vs stock", "losses agree", "real tokens/s",
           "x stock (tokens/s)", "peak above static (MiB)", "x stock (peak)", "peak phase",
           "fwd / bwd / opt peak above step start (MiB)", "CUDA peak reserved (MiB)", "what holds the peak", "status"]


def _variant_names(args: argparse.Namespace, model: str) -> list[str]:
    """The variants that run on ``model``: those that apply to its kind, SFTTrainer ones on ``--train-sft-models``;
    in --full without ``--train-variants``, :data:`CORE_VARIANTS` on models not in ``--train-every-variant-on``."""
    names = args.train_variants
    if args.train_full_run and not args.train_variants_given and model not in args.train_every_variant_on:
        names = [n for n in names if n in CORE_VARIANTS]
    return [n for n in variants_for(names, model_entry(model).kind)
            if VARIANTS[n].trainer == "hf" or model in args.train_sft_models]


def count(args: argparse.Namespace) -> int:
    """Progress steps: one per variant run, about eight per context search."""
    a, _ = resolved(args)
    runs = sum(len(_variant_names(a, m)) for m in a.train_models)
    planned = 3 * len(plans()) * len(a.train_context_models) if a.train_planned == "on" else 0
    projected = len(projection_searches()) if a.train_projection == "on" else 0
    return runs + (16 * len(a.train_context_models) if a.train_context == "on" else 0) + planned + projected


def _spec(args: argparse.Namespace, model: str, layers: int, variant: Variant, data: dict[str, Any]) -> dict[str, Any]:
    import dataclasses
    import json

    return {"model": model, "layers": layers, "variant": dataclasses.asdict(variant), "data": data,
            "overrides": json.loads(args.train_overrides) if getattr(args, "train_overrides", None) else None,
            "device": args.device, "dtype": dtypes(args)["train"].dtype, "lr": args.train_lr, "seed": 0}


def _mib(n: Optional[float]) -> Optional[float]:
    return None if n is None else n / MIB


def _reserved(r: dict[str, Any]) -> Optional[int]:
    """The caching allocator's largest pool over the phases (CUDA: ``max_memory_reserved``; CPU: None)."""
    values = [p["reserved"] for p in r.get("phases", {}).values() if p.get("reserved") is not None]
    return max(values) if values else None


def _command(args: argparse.Namespace, full: bool) -> str:
    flags = ["--train-models", *args.train_models, "--train-variants", *args.train_variants, "--train-steps",
             str(args.train_steps), "--train-docs", str(args.train_docs), "--train-row", str(args.train_row),
             "--train-context", args.train_context, "--train-budget", args.train_budget]
    if args.train_layers:
        flags += ["--train-layers", str(args.train_layers)]
    if getattr(args, "train_overrides", None):
        flags += ["--train-overrides", args.train_overrides]
    return "python -m bench --only train " + " ".join(shlex.quote(f) for f in flags)


def _model_tables(args: argparse.Namespace, model: str, full: bool, tick: Callable[[str], None]
                  ) -> tuple[list[Table], dict[str, Any]]:
    entry = model_entry(model)
    layers = _layers(args, model, full)
    names = _variant_names(args, model)
    data = {"steps": args.train_steps, "docs_per_step": args.train_docs, "row_len": args.train_row}
    results = {}
    for name in names:
        tick(f"train {model} {name}")
        results[name] = run_variant(_spec(args, model, layers, VARIANTS[name], data), args.train_timeout,
                                    getattr(args, "train_cache", None))
    ok = [n for n in names if "error" not in results[n]]
    dtype = dtypes(args)["train"].dtype
    tol = LOSS_TOLERANCE[dtype]
    ref = loss_reference(ok)
    rows, spread, agreement = [], {}, {}
    for name in names:
        r = results[name]
        if "error" in r:
            rows.append([name, VARIANTS[name].checkpointing] + [None] * (len(COLUMNS) - 3) + [r["error"]])
            continue
        diff, agree = loss_agreement(results[ref]["losses"], r["losses"], tol) if ref else (None, None)
        agreement[name] = agree
        base = same_checkpointing(name, ok)
        b = results.get(base) if base else None
        rows.append([
            name, VARIANTS[name].checkpointing, diff,
            None if agree is None else ("yes" if agree else "NO"),
            r["tokens_per_s"], ratio(r["tokens_per_s"], b and b["tokens_per_s"]),
            _mib(r["peak_above_static"]), ratio(r["peak_above_static"], b and b["peak_above_static"]),
            r["peak_phase"],
            phase_peaks(r), _mib(_reserved(r)), what_holds(r), "ok",
        ])
    static = next((results[n]["static"] for n in ok), None)
    first = results[ok[0]] if ok else {}
    notes = [
        entry.describe(layers, _spec(args, model, layers, Variant(), data)["overrides"]),
        f"{args.train_steps} optimizer steps of {args.train_docs} documents each; the first is a warm-up (optimizer "
        "state, first-call compilation): tokens/s and peaks come from the others, each peak above its step's start",
        "documents: " + DISTRIBUTION.describe(args.train_row) + f"; stock pads each step's documents to the longest, "
        f"packing fills rows of {args.train_row} (PackingCollator)",
        f"{dtype} ({dtypes(args)['train'].reason}); Trainer's default optimizer ({first.get('optimizer', '-')}), "
        f"constant lr {args.train_lr}, weight decay 0, gradient clipping 1.0",
        f"losses agree: every step within {tol:g} x max(1, |loss|) of {ref}'s (same documents, weights, seed; packed "
        "rows score the same tokens as padded rows, the same per-token mean)",
        "x stock: against stock with the same checkpointing and trainer (none: stock; Hugging Face's or a policy: "
        "stock+hf_gc; SFTTrainer rows: sft, sft+hf_gc)",
        "peak above static: the step's peak minus parameters, gradients and AdamW state; phases: peak above the "
        "step's start (gradients included) in forward+loss / backward (to the optimizer step, clipping included) / "
        "optimizer step",
    ]
    if static:
        notes.append(f"static state: parameters {static['params'] / MIB:.0f} MiB, gradients {static['grads'] / MIB:.0f} "
                     f"MiB, AdamW state {static['optimizer'] / MIB:.0f} MiB")
    slots = {n: sum(results[n]["slots"][1:]) for n in ok}
    if slots:
        real = sum(first["real_tokens"][1:])
        notes.append(f"real tokens in the measured steps: {real}; row slots: " + ", ".join(f"{n} {s}" for n, s in slots.items()))
    notes += [f"{n}: {DESCRIPTIONS[n]}" for n in names]
    table = Table(
        title=f"train: {model}, {layers} layer{'s' if layers != 1 else ''}, Trainer"
              f"{' and SFTTrainer' if any(VARIANTS[n].trainer == 'sft' for n in names) else ''}, stock vs library",
        columns=COLUMNS,
        rows=rows, command=_command(args, full), baseline=f"stock with the same checkpointing; losses: {ref}",
        notes=notes, spread=spread,
    )
    curves = Table(
        title=f"train: {model}, loss per step",
        columns=["step", *ok], rows=[[i + 1, *(results[n]["losses"][i] for n in ok)] for i in range(args.train_steps)],
        command=_command(args, full), baseline=ref, notes=["the first step is the warm-up; all steps are compared"],
    ) if ok else None
    compared = comparison_table(model, results, agreement, _command(args, full))
    return [t for t in (table, compared, curves) if t is not None], results


def run(args: argparse.Namespace, tick: Callable[[str], None]) -> Section:
    args, full = resolved(args)
    tables, data = [], {"models": {}}
    for model in args.train_models:
        t, data["models"][model] = _model_tables(args, model, full, tick)
        tables += t
    if args.train_context == "on":
        data["context"] = {}
        for model in args.train_context_models:
            layers = _layers(args, model, full)
            t, data["context"][model] = longest_context_table(
                args, model, layers, lambda v, d, m=model, n=layers: _spec(args, m, n, v, d),
                _command(args, full) + f" --train-context-models {model}", tick)
            tables.append(t)
    if getattr(args, "train_headline", None):
        for model in args.train_context_models:
            layers = _layers(args, model, full)
            command = (f"python -m bench --only train --train-models --train-headline {args.train_headline} "
                       f"--train-layers {layers} --train-steps {args.train_steps} --train-context-models {model} "
                       f"--train-dtype {dtypes(args)['train'].dtype}")
            t, data.setdefault("headline", {})[model] = headline_table(
                model, layers, args.train_headline, args.train_steps, dtypes(args)["train"].dtype,
                lambda v, d, m=model, n=layers: _spec(args, m, n, v, d), command, args.train_timeout, tick,
                getattr(args, "train_cache", None))
            tables.append(t)
    if args.train_planned == "on":
        for model in args.train_context_models:
            command = (f"python -m bench --only train --train-models --train-planned on --train-context-models {model} "
                       f"--train-dtype {dtypes(args)['train'].dtype}")
            t, data.setdefault("planned", {})[model] = planned_context_table(
                model, args.train_planned_layers, "bfloat16" if dtypes(args)["train"].dtype == "bf16" else "float32",
                command, args.train_timeout, tick)
            tables.append(t)
    if args.train_projection == "on":
        t, data["projection"] = projection_table("python -m bench --only train --train-models --train-projection on",
                                                 args.train_timeout, tick)
        tables.append(t)
    return Section(name="train", tables=tables, data=data)
