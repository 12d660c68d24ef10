"""``dist`` section: the vocabulary-parallel losses over 2 and 4 processes, per rank.

The section launches the processes itself (:mod:`bench.sections.dist.launch`) and reports, per rank (the
largest over ranks), the step time, the peak extra memory and the bytes handed to collectives in
forward and in backward, one table per measured thing:

  - :mod:`bench.sections.dist.vocab_logits`: cross-entropy from logits sharded over the vocabulary;
  - :mod:`bench.sections.dist.vocab_hidden`: cross-entropy from hidden states and a column-parallel LM head;
  - :mod:`bench.sections.dist.fsdp_step`: an FSDP2 Llama's training step, its own loss or the library's;
  - :mod:`bench.sections.dist.pipeline`: a 2-stage pipeline step, the last stage's ``loss_fn``;
  - :mod:`bench.sections.dist.context_parallel_step`: a Llama step on one packed row, the sequence
    sharded over 1, 2 and 4 processes (``enable_context_parallel``).

The quick run measures the two loss forms on 2 processes at N=512; ``--full`` the memory targets
of bench/RESULTS.md (logits [4096, 128256], hidden N=2048, H=512, V=32768) on 2 and 4 processes,
the FSDP2, pipeline and context-parallel steps, and the N sweep. The section's flags override either.

Dtypes (:mod:`bench.harness.host_dtype`): the logits form runs bf16 on every host (no matmuls); the
hidden-state form bf16 on CUDA and on CPUs with bf16 matrix units, fp32 on other CPUs;
``--dist-dtype``, ``--dist-hidden-dtype`` or ``--dtype`` choose. The FSDP2 and pipeline steps run fp32.
"""

from __future__ import annotations

import argparse
import os
import shlex
from pathlib import Path
from typing import Any, Callable

from bench.sections.dist.context_parallel_step import CP_VARIANTS
from bench.sections.dist.fsdp_step import FSDP_BASELINE, FSDP_VARIANTS
from bench.sections.dist.launch import launch
from bench.sections.dist.pipeline import PIPELINE_BASELINE, PIPELINE_VARIANTS
from bench.sections.dist.rank_setup import DTYPES, Variants
from bench.sections.dist.vocab_hidden import HIDDEN_BASELINE, HIDDEN_VARIANTS
from bench.sections.dist.vocab_logits import LOGITS_BASELINE, LOGITS_VARIANTS
from bench.harness.host_dtype import DtypeChoice, choose
from bench.harness.measure import Measurement
from bench.harness.modes import override, pick, sweeps
from bench.harness.plots import sweep_plots
from bench.harness.report import Section, Table, ratio, spreads


def add_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--dist-shape", help="N,V of the logits form (default 512,128256; --full 4096,128256, the "
                                            "memory target)")
    group.add_argument("--dist-dtype", choices=sorted(DTYPES),
                       help="logits dtype (default bf16 on every host: the logits form has no matmuls)")
    group.add_argument("--dist-hidden-shape", help="N,H,V of the hidden-state form (default 512,512,32768; --full "
                                                   "2048,512,32768)")
    group.add_argument("--dist-hidden-dtype", choices=sorted(DTYPES),
                       help="hidden-state form dtype (default: bf16 on CUDA and on CPUs with bf16 matrix units, "
                            "else fp32: bf16 matmuls can run 100x slower on CPUs without them)")
    group.add_argument("--dist-fsdp-shape", default="2048,256,32000",
                       help="tokens per rank, hidden size, vocabulary of the FSDP2 Llama (default 2048,256,32000)")
    group.add_argument("--dist-pipeline-shape", default="2048,256,32000",
                       help="tokens, hidden size, vocabulary of the 2-stage pipeline (default 2048,256,32000)")
    group.add_argument("--dist-cp-shape", default="8192,256,8192,4",
                       help="tokens of the packed row (in all), hidden size, vocabulary, layers of the "
                            "context-parallel Llama step (default 8192,256,8192,4)")
    group.add_argument("--dist-cp-worlds", default="1,2,4",
                       help="process counts of the context-parallel step (default 1,2,4; 1 is the baseline)")
    group.add_argument("--dist-worlds", help="process counts (default 2; --full 2,4)")
    group.add_argument("--dist-models", choices=["on", "off"],
                       help="the FSDP2, pipeline and context-parallel training-step tables (default off; --full on)")
    group.add_argument("--dist-repeats", type=int, default=2, help="timed steps per variant (median)")
    group.add_argument("--dist-sweep", default="512,1024,2048,4096",
                       help="token counts N for the --plot sweep (2 processes; V from --dist-shape)")


def dtypes(args: argparse.Namespace) -> dict[str, DtypeChoice]:
    """Each loss form's dtype and why: its own flag, else ``--dtype``, else the host's default."""
    return {"dist logits": choose(args, "--dist-dtype", matmuls=False),
            "dist hidden": choose(args, "--dist-hidden-dtype", matmuls=True)}


def _resolved(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with the quick or full defaults of the flags the user left unset."""
    chosen = dtypes(args)
    return override(args, dist_shape=pick(args, args.dist_shape, "512,128256", "4096,128256"),
                    dist_dtype=chosen["dist logits"].dtype, dist_hidden_dtype=chosen["dist hidden"].dtype,
                    dist_hidden_shape=pick(args, args.dist_hidden_shape, "512,512,32768", "2048,512,32768"),
                    dist_worlds=pick(args, args.dist_worlds, "2", "2,4"),
                    dist_models=pick(args, args.dist_models, "off", "on"))


def count(args: argparse.Namespace) -> int:
    """Progress steps: one per variant launched."""
    a = _resolved(args)
    worlds = len(a.dist_worlds.split(","))
    steps = worlds * (len(LOGITS_VARIANTS) + len(HIDDEN_VARIANTS))
    if a.dist_models == "on":
        steps += worlds * len(FSDP_VARIANTS) + len(PIPELINE_VARIANTS)
        steps += len(a.dist_cp_worlds.split(",")) * len(CP_VARIANTS)
    if sweeps(a):
        steps += len(a.dist_sweep.split(",")) * (len(LOGITS_VARIANTS) + len(HIDDEN_VARIANTS))
    return steps


def _command(args: argparse.Namespace) -> str:
    return "python -m bench --only dist " + " ".join(shlex.quote(a) for a in [
        "--dist-shape", args.dist_shape, "--dist-dtype", args.dist_dtype, "--dist-hidden-shape",
        args.dist_hidden_shape, "--dist-hidden-dtype", args.dist_hidden_dtype, "--dist-fsdp-shape",
        args.dist_fsdp_shape, "--dist-pipeline-shape", args.dist_pipeline_shape, "--dist-cp-shape",
        args.dist_cp_shape, "--dist-cp-worlds", args.dist_cp_worlds,
        "--dist-worlds", args.dist_worlds, "--dist-models", args.dist_models,
        "--device", args.device,
    ])


def _measure_all(variants: Variants, shape: dict[str, Any], world: int,
                 args: argparse.Namespace, tick: Callable[[str], None]) -> dict[str, Measurement]:
    out = {}
    for name, (setup, extra) in variants.items():
        tick(f"dist {name} x{world} N={shape['n']}")
        out[name] = launch(setup, {**shape, **extra}, world=world, device=args.device, repeats=args.dist_repeats)
    return out


def _rows(results: dict[int, dict[str, Measurement]], baseline: str, n: int) -> list[list[Any]]:
    rows = []
    for world, by_variant in results.items():
        base = by_variant[baseline]
        for name, m in by_variant.items():
            fwd, bwd = m.extra.get("forward_bytes"), m.extra.get("backward_bytes")
            rows.append([
                world, name, m.ms, m.peak_mib, ratio(m.peak_extra_bytes, base.peak_extra_bytes),
                None if fwd is None else fwd / n, None if bwd is None else bwd / 2**20, m.error or "ok",
            ])
    return rows


#: (measurement key, axis label, scale, file suffix) of the sweep's plots, per rank.
SWEEP_METRICS = (
    ("peak_extra_bytes", "peak extra memory per rank (MiB)", 1 / 2**20, "memory"),
    ("forward_bytes", "forward bytes to collectives per rank (MiB)", 1 / 2**20, "forward_bytes"),
    ("backward_bytes", "backward bytes to collectives per rank (MiB)", 1 / 2**20, "backward_bytes"),
    ("seconds", "forward+backward time (ms)", 1e3, "time"),
)
COLUMNS = ["ranks", "variant", "time (ms)", "peak extra/rank (MiB)", "x baseline", "fwd bytes/token/rank",
           "bwd MiB/rank", "status"]


def run(args: argparse.Namespace, tick: Callable[[str], None]) -> Section:
    chosen = dtypes(args)
    args = _resolved(args)
    n, v = (int(x) for x in args.dist_shape.split(","))
    hn, hh, hv = (int(x) for x in args.dist_hidden_shape.split(","))
    worlds = [int(x) for x in args.dist_worlds.split(",")]
    logits_shape = {"n": n, "v": v, "dtype": args.dist_dtype}
    hidden_shape = {"n": hn, "h": hh, "v": hv, "dtype": args.dist_hidden_dtype}
    logits = {w: _measure_all(LOGITS_VARIANTS, logits_shape, w, args, tick) for w in worlds}
    hidden = {w: _measure_all(HIDDEN_VARIANTS, hidden_shape, w, args, tick) for w in worlds}
    mem_how = "CUDA max_memory_allocated" if args.device.startswith("cuda") else "peak RSS of each rank's process"
    notes = [
        f"per rank: the largest over ranks; peak extra memory = {mem_how} above the inputs during the step "
        "(the logits' gradient counts); bytes = what each rank hands to collectives (counted in one extra eager step)",
    ]
    tables = [
        Table(title=f"vocabulary-parallel cross-entropy from logits, forward+backward, [{n}, {v}] {args.dist_dtype} "
                    f"sharded over the vocabulary, {args.device}",
              columns=COLUMNS, rows=_rows(logits, LOGITS_BASELINE, n),
              baseline=f"{LOGITS_BASELINE}: torch's loss_parallel() on logits.float(), the same ranks",
              notes=notes + [f"dtype {chosen['dist logits']}"], command=_command(args), keys=2,
              spread=_spreads(logits)),
        Table(title=f"vocabulary-parallel hidden-state loss, forward+backward, N={hn}, H={hh}, V={hv} "
                    f"{args.dist_hidden_dtype}, column-parallel lm_head, {args.device}",
              columns=COLUMNS, rows=_rows(hidden, HIDDEN_BASELINE, hn),
              baseline=f"{HIDDEN_BASELINE}: F.cross_entropy(lm_head(hidden).float()) under loss_parallel()",
              notes=notes + [f"dtype {chosen['dist hidden']}"], command=_command(args), keys=2,
              spread=_spreads(hidden)),
    ]
    data: dict[str, Any] = {
        "logits": {"shape": [n, v], "dtype": args.dist_dtype, "dtype_choice": chosen["dist logits"].to_json(),
                   "by_world": {w: {k: vars(m) for k, m in r.items()} for w, r in logits.items()}},
        "hidden": {"shape": [hn, hh, hv], "dtype": args.dist_hidden_dtype,
                   "dtype_choice": chosen["dist hidden"].to_json(),
                   "by_world": {w: {k: vars(m) for k, m in r.items()} for w, r in hidden.items()}},
        "device": args.device,
    }
    if args.dist_models == "on":
        model_tables, model_data = _training_steps(args, worlds, notes, tick)
        tables += model_tables
        data.update(model_data)
    if sweeps(args):
        for form, variants, shape in (("logits", LOGITS_VARIANTS, logits_shape), ("hidden", HIDDEN_VARIANTS,
                                                                                    hidden_shape)):
            sweep = {}
            for sn in (int(x) for x in args.dist_sweep.split(",")):
                measured = _measure_all(variants, {**shape, "n": sn}, 2, args, tick)
                sweep[sn] = {k: _flat(m) for k, m in measured.items()}
            data[form]["sweep"] = {"world": 2, "by_n": sweep}
    return Section(name="functional_ce: vocabulary-parallel losses (DTensor)", tables=tables, data=data)


def _training_steps(args: argparse.Namespace, worlds: list[int], notes: list[str],
                    tick: Callable[[str], None]) -> tuple[list[Table], dict[str, Any]]:
    """The FSDP2 Llama step (every world) and the 2-stage pipeline step (2 processes)."""
    fn, fh, fv = (int(x) for x in args.dist_fsdp_shape.split(","))
    fsdp_shape = {"n": fn, "h": fh, "v": fv, "dtype": "fp32"}
    fsdp = {w: _measure_all(FSDP_VARIANTS, fsdp_shape, w, args, tick) for w in worlds}
    pn, ph, pv = (int(x) for x in args.dist_pipeline_shape.split(","))
    pipeline_shape = {"n": pn, "h": ph, "v": pv, "dtype": "fp32"}
    pipeline = {2: _measure_all(PIPELINE_VARIANTS, pipeline_shape, 2, args, tick)}
    tables = [
        Table(title=f"FSDP2 training step, 2-layer Llama (hidden {fh}, V={fv}) fp32, {fn} tokens per rank, "
                    f"fully_shard on each layer and the root, {args.device}",
              columns=COLUMNS, rows=_rows(fsdp, FSDP_BASELINE, fn),
              baseline=f"{FSDP_BASELINE}: the model's own loss (fp32 logits and their log-softmax)",
              notes=notes[:1] + [f"one fp32 logits copy here: {fn} x {fv} x 4 bytes = {fn * fv * 4 / 2**20:.0f} MiB"],
              command=_command(args), keys=2, spread=_spreads(fsdp)),
        Table(title=f"2-stage pipeline (GPipe, 4 microbatches), {pn} tokens, hidden {ph}, V={pv} fp32, the last "
                    f"stage's loss_fn, {args.device}",
              columns=COLUMNS, rows=_rows(pipeline, PIPELINE_BASELINE, pn),
              baseline=f"{PIPELINE_BASELINE}: summed over the microbatch, divided by the global label count",
              notes=notes[:1] + ["one step = schedule.step (forward and backward of every microbatch); the "
                                 "activations the stages send each other (point-to-point) are not counted"],
              command=_command(args), keys=2, spread=_spreads(pipeline)),
    ]
    cp_table, cp_data = _context_parallel(args, notes, tick)
    tables.append(cp_table)
    data = {
        "context_parallel": cp_data,
        "fsdp": {"shape": [fn, fh, fv], "dtype": "fp32",
                 "by_world": {w: {k: vars(m) for k, m in r.items()} for w, r in fsdp.items()}},
        "pipeline": {"shape": [pn, ph, pv], "dtype": "fp32",
                     "by_world": {w: {k: vars(m) for k, m in r.items()} for w, r in pipeline.items()}},
    }
    return tables, data


def _context_parallel(args: argparse.Namespace, notes: list[str],
                      tick: Callable[[str], None]) -> tuple[Table, dict[str, Any]]:
    """The packed-row step at each process count of ``--dist-cp-worlds``, the same total tokens."""
    cn, ch, cv, layers = (int(x) for x in args.dist_cp_shape.split(","))
    shape = {"n": cn, "h": ch, "v": cv, "layers": layers, "dtype": "fp32"}
    worlds = [int(x) for x in args.dist_cp_worlds.split(",")]
    (name, (setup, extra)), = CP_VARIANTS.items()
    measured = {}
    for world in worlds:
        tick(f"dist {name} x{world} N={cn}")
        measured[world] = launch(setup, {**shape, **extra}, world=world, device=args.device, repeats=args.dist_repeats)
    base = measured[min(worlds)]
    columns = ["processes", "tokens/process", "time (ms)", "tokens/s", "peak extra/process (MiB)", "x one process",
               "1/P + 15%", "fwd MiB/process", "status"]
    rows = []
    for world, m in measured.items():
        fwd = m.extra.get("forward_bytes")
        rows.append([world, cn // world, m.ms, None if not m.seconds else cn / m.seconds, m.peak_mib,
                     ratio(m.peak_extra_bytes, base.peak_extra_bytes), round(1 / world + 0.15, 3),
                     None if fwd is None else fwd / 2**20, m.error or "ok"])
    table = Table(
        title=f"context parallelism with packed documents: a {layers}-layer Llama (hidden {ch}, V={cv}) fp32 step on "
              f"one packed row of {cn} tokens in all (log-normal documents, median 512), sharded over P processes, "
              f"{args.device}",
        columns=columns, rows=rows,
        baseline=f"P = {min(worlds)}: the whole row on one process, the packing patch's [tokens, tokens] document mask",
        notes=notes[:1] + ["the hidden-state loss; gradients all-reduced over the processes after backward; "
                           f"processes share this machine's {os.cpu_count()} cores (torch threads = cores / P), so "
                           "tokens/s shows the cost of the gathers and masks here, not a speed-up",
                           "fwd MiB = keys and values all-gathered in forward (each process's share)"],
        command=_command(args), keys=1, spread={str(w): m.spread for w, m in measured.items() if m.spread})
    data = {"shape": [cn, ch, cv, layers], "dtype": "fp32", "by_world": {w: vars(m) for w, m in measured.items()}}
    return table, data


def _spreads(results: dict[int, dict[str, Measurement]]) -> dict[str, float]:
    """Row name (``"ranks / variant"``) -> the spread of its timed steps."""
    return {f"{world} / {name}": spread for world, by_variant in results.items()
            for name, spread in spreads(by_variant).items()}


def _flat(m: Measurement) -> dict[str, Any]:
    """A measurement as the plots read it: time, peak memory and bytes at the top level."""
    out = {k: v for k, v in vars(m).items() if k != "extra"}
    for key in ("forward_bytes", "backward_bytes"):
        out[key] = m.extra.get(key)
    return out


def plot(section: Section, out_dir: Path) -> list[Path]:
    """Per-rank peak memory, communicated bytes (forward, backward) and time against N, at 2
    processes, one line per variant, for each form."""
    paths = []
    for form, what in (("logits", "CE from logits"), ("hidden", "hidden-state CE")):
        data = section.data[form]
        sweep = data.get("sweep") or {}
        sizes = {k: x for k, x in zip("NHV" if form == "linear" else "NV", data["shape"]) if k != "N"}
        paths += sweep_plots(sweep.get("by_n"), out_dir, stem=f"dist_{form}", what=f"vocabulary-parallel {what}",
                             sizes=sizes, details=[f"{sweep.get('world')} ranks", data["dtype"]], metrics=SWEEP_METRICS)
    return paths
