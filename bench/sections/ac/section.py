"""``ac`` section: what each activation-checkpointing preset keeps and recomputes on a small MoE model.

For every preset, side by side with no checkpointing in the same run: activation bytes kept
for backward (storages still referenced after forward, and bytes packed by saved-tensor
hooks), the step peak (most activation bytes alive at once over forward plus backward), recompute FLOPs (``FlopCounterMode`` over forward+backward, minus the same count
without checkpointing) with the MoE blocks' share, and the median step time.

Then :mod:`bench.sections.ac.budgets`: ``ac_policies.fit`` at 0.5 / 0.7 / 0.9 of the step peak next to
the presets and to ``torch.compile``'s ``activation_memory_budget``, on a dense and a MoE model;
and :mod:`bench.sections.ac.estimate`: ``ac_policies.estimate`` on fake tensors against the measured step.
"""

from __future__ import annotations

import argparse
import shlex
import time
import warnings
from typing import Any, Callable

import torch

import ac_policies
from ac_policies.measure import kept_for_backward, recompute_flops, step_bytes
from bench.harness.measure import spread_of
from bench.harness.modes import override, pick
from bench.harness.report import Section, Table, ratio
from bench.sections.ac import budgets as ac_budgets
from bench.sections.ac import estimate as ac_estimate
from bench.sections.ac.model import build, model_config

# A table written as config data: non_moe, except that each MoE block runs under op-level
# checkpointing that keeps every matmul output (router and expert GEMMs) and recomputes only
# gathers, routing arithmetic and activations. Not a preset: it checkpoints the MoE block, and
# expert code that mutates a grouped-GEMM output in place (GPT-OSS adds its bias in place) makes
# torch's selective checkpoint raise.
MOE_SELECTIVE_TABLE = [
    {"match": "*", "when": "moe", "action": "selective", "ops": ["mm", "addmm", "_grouped_mm"], "on_unmatched": "error"},
    {"match": "*", "when": {"inside": "moe"}, "action": "none"},
    *ac_policies.PRESETS["non_moe"].to_dicts()[1:],
]
MOE_SELECTIVE = "table: non_moe + selective MoE"
VARIANTS: dict[str, Any] = {
    **{p: p for p in ("none", "full", "selective", "non_moe", "non_moe_no_attn")},
    MOE_SELECTIVE: MOE_SELECTIVE_TABLE,
}
MIB = 2**20


def add_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--ac-seq", type=int, default=512, help="sequence length (batch 1; default 512)")
    group.add_argument("--ac-layers", type=int, default=2, help="decoder layers of the MoE model (default 2)")
    group.add_argument("--ac-repeats", type=int,
                       help="at most this many timed steps per preset (best reported; default 3, --full 10)")
    group.add_argument("--ac-time-budget", type=float,
                       help="stop timing after this many seconds once every preset has 2 steps (default 4, --full 8)")
    group.add_argument("--ac-sensitivity", choices=["on", "off"],
                       help="the table of other MoE shapes (default off, --full on)")
    ac_budgets.add_arguments(group)
    ac_estimate.add_arguments(group)


def _resolved(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with the quick or full defaults of the flags the user left unset."""
    return override(args, ac_repeats=pick(args, args.ac_repeats, 3, 10),
                    ac_time_budget=pick(args, args.ac_time_budget, 4.0, 8.0),
                    ac_sensitivity=pick(args, args.ac_sensitivity, "off", "on"))


def count(args: argparse.Namespace) -> int:
    """Progress steps: each preset measured, then timed each round, then the other shapes, then the
    budget tables (:mod:`bench.sections.ac.budgets`)."""
    a = _resolved(args)
    return len(VARIANTS) * (1 + a.ac_repeats) + (3 if a.ac_sensitivity == "on" else 0) + ac_budgets.count(args) + ac_estimate.count(args)


def measure_preset(model, preset: str, ids: torch.Tensor, moe_fqns: list[str]) -> dict[str, Any]:
    """Kept bytes and recompute FLOPs (all, MoE) of one training step under ``preset``."""

    def step() -> torch.Tensor:
        return model(input_ids=ids, labels=ids).loss

    kept = {}

    def forward() -> torch.Tensor:
        loss, kept["bytes"] = kept_for_backward(model, step)
        return loss

    with _applied(model, preset) as handle:
        model.zero_grad(set_to_none=True)
        flops, moe_flops = recompute_flops(model, forward, moe_fqns)
        peak = step_bytes(model, step).peak
    kb = kept["bytes"]
    return {"wrapped": len(handle.plan.wrapped), "live": kb.live, "saved": kb.saved, "peak": peak,
            "flops": flops, "moe_flops": moe_flops}


def _applied(model, variant: str) -> ac_policies.PolicyHandle:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ac_policies.ACPolicyWarning)  # `full` warns about MoE recompute
        return ac_policies.apply_policy(model, VARIANTS[variant])


def time_presets(model, ids: torch.Tensor, repeats: int, budget_s: float, tick: Callable[[str], None]) -> dict[str, list[float]]:
    """Step times (s) per preset, in rounds where presets take turns so load changes hit them alike.

    Rounds stop after ``repeats``, or once ``budget_s`` is spent and every preset has 2 steps.
    """
    times: dict[str, list[float]] = {p: [] for p in VARIANTS}
    start = time.perf_counter()
    for r in range(repeats):
        if r >= 2 and time.perf_counter() - start > budget_s:
            break
        for preset in VARIANTS:
            tick(f"ac time {preset} ({r + 1}/{repeats})")
            with _applied(model, preset):
                model.zero_grad(set_to_none=True)
                if ids.is_cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                model(input_ids=ids, labels=ids).loss.backward()
                if ids.is_cuda:
                    torch.cuda.synchronize()
                times[preset].append(time.perf_counter() - t0)
    return times


def _moe_fqns(model) -> list[str]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [r.fqn for r in ac_policies.plan(model, [ac_policies.Rule(when="moe", action="none")])]


def sensitivity(args: argparse.Namespace, tick: Callable[[str], None]) -> list[list[Any]]:
    """Kept bytes and step peaks of none, non_moe and the MoE-selective table on other MoE shapes."""
    shapes = {
        "query 8x32 = hidden (Llama/Mixtral-like)": dict(head_dim=32),
        "top-8 of 32, intermediate 96 (Qwen3-30B-A3B-like)": dict(num_experts=32, num_experts_per_tok=8, moe_intermediate_size=96),
        "top-2 of 8, intermediate 896 (Mixtral-like)": dict(moe_intermediate_size=896),
    }
    rows = []
    ids = torch.randint(2, 1024, (1, args.ac_seq), generator=torch.Generator().manual_seed(0)).to(args.device)
    for label, over in shapes.items():
        tick(f"ac sensitivity: {label}")
        model = build(model_config(args.ac_seq, args.ac_layers, **over), args.device)
        got = {}
        for variant in ("none", "non_moe", MOE_SELECTIVE):
            with _applied(model, variant):
                got[variant] = step_bytes(model, lambda: model(input_ids=ids, labels=ids).loss)
        rows.append(_sensitivity_row(label, {k: (v.kept, v.peak) for k, v in got.items()}))
    return rows


def _sensitivity_row(label: str, got: dict[str, tuple[int, int]]) -> list[Any]:
    """``got``: variant -> (kept, peak) bytes."""
    (kn, pn), (km, pm), (ks, ps) = got["none"], got["non_moe"], got[MOE_SELECTIVE]
    return [label, kn / MIB, pn / MIB, ratio(km, kn), ratio(pm, pn), ratio(ks, kn), ratio(ps, pn)]


def _command(args: argparse.Namespace) -> str:
    opts = ["--ac-seq", str(args.ac_seq), "--ac-layers", str(args.ac_layers), "--ac-repeats", str(args.ac_repeats),
            "--ac-time-budget", str(args.ac_time_budget), "--ac-sensitivity", args.ac_sensitivity,
            "--device", args.device]
    return "python -m bench --only ac " + " ".join(shlex.quote(a) for a in opts)


def run(args: argparse.Namespace, tick: Callable[[str], None]) -> Section:
    args = _resolved(args)
    cfg = model_config(args.ac_seq, args.ac_layers)
    model = build(cfg, args.device)
    ids = torch.randint(2, cfg["vocab_size"], (1, args.ac_seq), generator=torch.Generator().manual_seed(0)).to(args.device)
    moe_fqns = _moe_fqns(model)
    results = {}
    for preset in VARIANTS:  # the measured step also warms up the timed ones
        tick(f"ac {preset}")
        results[preset] = measure_preset(model, preset, ids, moe_fqns)
    # the best step, not the median: on a CPU shared with other jobs, slow steps time the other jobs
    for preset, ts in time_presets(model, ids, args.ac_repeats, args.ac_time_budget, tick).items():
        results[preset]["ms"] = 1e3 * min(ts)
        results[preset]["steps_ms"] = [1e3 * t for t in ts]
    rounds = len(results["none"]["steps_ms"])
    base = results["none"]
    rows = []
    for preset, r in results.items():
        recompute, moe_recompute = r["flops"], r["moe_flops"]
        rows.append([
            preset, r["wrapped"], r["live"] / MIB, ratio(r["live"], base["live"]), r["peak"] / MIB,
            ratio(r["peak"], base["peak"]), r["saved"] / MIB, recompute / 1e9, moe_recompute / 1e9,
            ratio(moe_recompute, recompute), r["ms"], ratio(r["ms"], base["ms"]),
        ])
    model_desc = (
        f"Qwen3-MoE, {args.ac_layers} layers, hidden 256, 8x64 query heads, 4 KV heads, 8 experts top-2 "
        f"(intermediate 128), vocab 1024, fp32, sdpa; batch 1 x seq {args.ac_seq}, random init"
    )
    table = Table(
        title=f"activation checkpointing presets on a small MoE model ({args.device})",
        columns=["preset", "wrapped", "kept (MiB)", "x none", "step peak (MiB)", "x none", "hooks (MiB)",
                 "recompute (GFLOP)", "MoE recompute (GFLOP)", "MoE share", "best step (ms)", "x none"],
        rows=rows,
        baseline="none: the same model without checkpointing, same run",
        notes=[
            f"model: {model_desc}",
            "kept = bytes of forward-op outputs still referenced when forward returns (autograd's saved "
            "tensors, checkpoint inputs, selective's cache), parameters and the loss excluded",
            "step peak = the most activation bytes alive at once over forward plus backward (recompute, "
            "activation gradients and backward temporaries included; parameters and their gradients excluded): "
            "what decides out-of-memory; kept only bounds what is held between forward and backward",
            "hooks = bytes packed by saved-tensor hooks; these miss selective's cached matmul outputs",
            "recompute = FLOPs of forward ops rerun during backward (torch's FLOP formulas plus _grouped_mm "
            "and CPU flash attention); MoE = the part run inside the MoE blocks (router, experts, shared experts)",
            f"best step = fastest of {rounds} forward+backward steps per preset, presets taking turns "
            "(the CPU may be shared with other jobs; every step is in --json)",
        ],
        command=_command(args),
        spread={preset: s for preset, r in results.items() if (s := spread_of(r["steps_ms"])) is not None},
    )
    first = {k: (results[k]["live"], results[k]["peak"]) for k in ("none", "non_moe", MOE_SELECTIVE)}
    sens = [_sensitivity_row("the model above", first)]
    sens += sensitivity(args, tick) if args.ac_sensitivity == "on" else []
    table2 = Table(
        title=f"kept bytes and step peak vs none across MoE shapes ({args.ac_layers} layers, seq {args.ac_seq})",
        columns=["shape", "none kept (MiB)", "none peak (MiB)", "non_moe kept x none", "non_moe peak x none",
                 "MoE-selective kept x none", "MoE-selective peak x none"],
        rows=sens,
        baseline="none on the same shape",
        notes=["non_moe keeps every activation of the MoE blocks by design, so the saving shrinks as "
               "the experts' share of activations grows (many small experts per token, or large ones)",
               "peak ratios are closer to 1 than kept ratios: backward holds activation gradients and "
               "temporaries no policy removes, and recompute rebuilds a region's activations",
               f"MoE-selective table = {MOE_SELECTIVE!r} in the table above: it reruns no matmul inside the "
               "MoE blocks but does rerun their gathers, routing arithmetic and activations"],
        command=_command(args),
    )
    data = {"config": cfg, "seq": args.ac_seq, "results": results,
            "sensitivity": {r[0]: {"none_kept_mib": r[1], "none_peak_mib": r[2], "non_moe_kept_x": r[3],
                                   "non_moe_peak_x": r[4], "moe_selective_kept_x": r[5], "moe_selective_peak_x": r[6]}
                            for r in sens},
            "moe_selective_table": MOE_SELECTIVE_TABLE}
    budget_tables, data["budgets"] = ac_budgets.run(args, tick)
    estimate_tables, data["estimate"] = ac_estimate.run(args, tick)
    return Section(name="ac: activation-checkpointing policies", tables=[table, table2, *budget_tables, *estimate_tables],
                   data=data)


def plot(section: Section, out_dir) -> list:
    """``ac_presets.png``: kept bytes and step peak, and recompute FLOPs (MoE part stacked), per preset."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = section.data["results"]
    names = list(results)
    kept = [results[n]["live"] / MIB for n in names]
    peak = [results[n]["peak"] / MIB for n in names]
    moe = [results[n]["moe_flops"] / 1e9 for n in names]
    rest = [results[n]["flops"] / 1e9 - m for n, m in zip(names, moe)]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    x = range(len(names))
    a.bar([i - 0.2 for i in x], kept, width=0.4, color="tab:blue", label="kept after forward")
    a.bar([i + 0.2 for i in x], peak, width=0.4, color="tab:purple", label="step peak")
    a.set_xticks(list(x), names)
    a.axhline(0.6 * peak[names.index("none")], color="grey", ls=":", lw=1)
    a.annotate("60% of none's peak", (0, 0.6 * peak[names.index("none")]), fontsize=7, color="grey", va="bottom")
    a.set_ylabel("activation bytes (MiB)")
    a.legend(fontsize=8)
    b.bar(names, rest, label="outside MoE blocks", color="tab:orange")
    b.bar(names, moe, bottom=rest, label="inside MoE blocks", color="tab:red")
    b.set_ylabel("recomputed in backward (GFLOP)")
    b.legend(fontsize=8)
    for ax in (a, b):
        ax.tick_params(axis="x", labelrotation=25, labelsize=8)
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(f"activation checkpointing presets, {section.data['seq']} tokens, small Qwen3-MoE", fontsize=10)
    fig.tight_layout()
    path = out_dir / "ac_presets.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]
