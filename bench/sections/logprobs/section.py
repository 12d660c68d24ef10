"""``logprobs`` section: per-token losses over the vocabulary, forward + backward, against the
full-logits path, ``torch.compile`` and TRL's chunked kernels.

Each variant runs in its own process (:mod:`bench.harness.measure`; the steps are in
:mod:`bench.sections.logprobs.steps`), side by side in one run: time and peak extra memory, and their
ratios against the eager baseline and against it compiled. A variant whose optional peer or
``functional_ce`` entry point is missing is left out with a note.

Table "token log-probs with entropy from hidden states" (the GRPO / PPO policy term): hidden
``[N, H]`` and weight ``[V, H]`` (both require grad) in ``--logprobs-dtype`` (default: bf16 on
CUDA and on CPUs with bf16 matrix units, fp32 on other CPUs; :mod:`bench.harness.host_dtype`),
labels ``[N]`` int64. The upstream gradient is per token:
``loss = -(adv * logp).sum() - 0.01 * entropy.sum()`` with a fixed random fp32 ``adv`` ``[N]``.
  - ``eager full path (TRL formulas)``, the baseline: ``z = F.linear(h, w).float() / T``;
    ``logp = log_softmax(z)`` gathered at the label (TRL's ``selective_log_softmax``);
    ``entropy = -(softmax(z) * log_softmax(z)).sum(-1)`` (TRL's ``entropy_from_logits``);
  - ``the same under torch.compile``;
  - ``TRL ChunkedLogProbFunction``: ``trl.kernels.chunked_logprob`` of trl>=1.16 (Triton on
    CUDA, its torch tiles elsewhere), vocabulary chunk 32768 as TRL's trainer calls it;
  - ``functional_ce.linear_token_logprobs(h, w, labels, temperature=T, return_entropy=True)``,
    which returns ``(logp, entropy)``, fp32 ``[N]``.

Tables "distillation, generalized JSD": TRL GKD's divergence, ``beta = 0.5``. Per token, with
fp32 ``s = log_softmax(student / T)``, ``t = log_softmax(teacher / T)`` and
``m = logsumexp(stack([s + log(1 - beta), t + log(beta)]), 0)``, ``jsd = beta * KL(t || m) +
(1 - beta) * KL(s || m)`` summed over V; the loss is the fp32 mean over tokens.
  - from hidden states: student hidden ``[N, H]`` and weight ``[V, H]`` (require grad), teacher
    hidden ``[N, H]`` and weight ``[V, H]`` (no grad); eager (logits through ``F.linear``),
    compiled, ``TRL ChunkedDivergenceFunction`` (trl>=1.16), Liger-Kernel's ``LigerFusedLinearJSD``
    (CUDA only; its generalized JSD with ``jsd_beta = beta``, mean over tokens),
    ``functional_ce.linear_distillation_loss``;
  - from logits: student logits ``[N, V]`` (require grad) and teacher logits ``[N, V]``; eager,
    compiled and ``functional_ce.distillation_loss``.

Shapes: the default run is quick (N=1024, H=512, V=16384; the log-prob and hidden-state
distillation tables). ``--logprobs-full`` runs the target
shapes: log-probs N=4096, H=1024, V=32768; distillation from hidden states N=1024 and N=2048,
H=1024, V=32768; from logits N=4096, V=32768. ``--logprobs-n`` / ``-h`` / ``-v`` override either.
With ``--plot``, each table is also measured over an N sweep (``--logprobs-sweep``; default
256,512,1024; full 1024,2048,4096, 512,1024,2048 from hidden states) and drawn against N.

    python -m bench --only logprobs
    python -m bench --only logprobs --logprobs-full --plot bench/plots
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.metadata
import importlib.util
import shlex
from pathlib import Path
from typing import Any, Callable, Optional

from packaging.version import Version

from bench.harness.host_dtype import DtypeChoice, choose
from bench.harness.measure import Measurement, measure
from bench.harness.modes import is_full, override, sweeps
from bench.harness.plots import sweep_plots
from bench.harness.report import Section, Table, ratio, spreads
from bench.sections.logprobs import steps
from bench.sections.logprobs.steps import DTYPES

BASELINE = "eager full path (TRL formulas)"
COMPILED = "the same under torch.compile"


# --- what is measured -------------------------------------------------------------------------

def _always(device: str) -> Optional[str]:
    return None


def _trl_available(device: str) -> Optional[str]:
    if importlib.util.find_spec("trl") is None:
        return "trl not installed; pip install 'trl>=1.16'"
    version = importlib.metadata.version("trl")
    return None if Version(version) >= Version("1.16") else f"trl {version} has no chunked kernels (needs >= 1.16)"


def _liger_available(device: str) -> Optional[str]:
    if not device.startswith("cuda"):
        return "Liger-Kernel's fused linear JSD runs on CUDA only"
    if importlib.util.find_spec("liger_kernel") is None:
        return "liger-kernel not installed; pip install liger-kernel"
    return None


def _ours_available(name: str) -> Callable[[str], Optional[str]]:
    """None where ``functional_ce`` has ``name``, else the reason to leave the variant out."""
    return lambda device: None if hasattr(importlib.import_module("functional_ce"), name) else \
        f"this functional_ce has no {name}"


@dataclasses.dataclass(frozen=True)
class Problem:
    """One loss: its setup (a module-level function), the peers' variants ``name -> (impl, availability)``,
    its ``functional_ce`` entry point, whether its inputs are hidden states, plot file stem, the
    baseline's formula."""

    title: str
    setup: Callable[..., Callable[[], Any]]
    peers: dict[str, tuple[str, Callable[[str], Optional[str]]]]
    entry_point: str
    hidden: bool
    stem: str
    formula: str

    @property
    def variants(self) -> dict[str, tuple[str, Callable[[str], Optional[str]]]]:
        """``name -> (impl, availability)``: the baseline, it compiled, the peers, then functional_ce's."""
        return {BASELINE: ("eager", _always), COMPILED: ("compiled", _always), **self.peers,
                f"functional_ce.{self.entry_point}": ("ours", _ours_available(self.entry_point))}


PROBLEMS = {
    "logprobs": Problem(
        title="token log-probs with entropy from hidden states", setup=steps.setup_logprobs,
        peers={"TRL ChunkedLogProbFunction": ("trl", _trl_available)},
        entry_point="linear_token_logprobs", hidden=True, stem="logprobs_hidden",
        formula="z = F.linear(hidden, weight).float() / T; logp = log_softmax(z)[label]; entropy = "
                "-(softmax(z) * log_softmax(z)).sum(-1); loss = -(adv * logp).sum() - 0.01 * entropy.sum()"),
    "distill_hidden": Problem(
        title="distillation, generalized JSD (beta=0.5) from hidden states",
        setup=steps.setup_distill_hidden,
        peers={"TRL ChunkedDivergenceFunction": ("trl", _trl_available),
               "liger LigerFusedLinearJSD (CUDA)": ("liger", _liger_available)},
        entry_point="linear_distillation_loss", hidden=True, stem="distill_hidden",
        formula="student and teacher logits through F.linear, .float() / T, log_softmax each; TRL GKD's "
                "beta * KL(t||m) + (1 - beta) * KL(s||m) summed over V, mean over tokens; teacher without grad"),
    "distill_logits": Problem(
        title="distillation, generalized JSD (beta=0.5) from logits", setup=steps.setup_distill_logits,
        peers={}, entry_point="distillation_loss", hidden=False, stem="distill_logits",
        formula="student_logits.float() / T and teacher_logits.float() / T, log_softmax each; TRL GKD's "
                "beta * KL(t||m) + (1 - beta) * KL(s||m) summed over V, mean over tokens"),
}


@dataclasses.dataclass(frozen=True)
class Shapes:
    """Token counts of a problem's tables, H and V, and the token counts of its plot sweep."""

    ns: tuple[int, ...]
    h: int
    v: int
    sweep: tuple[int, ...]


QUICK = {key: Shapes((1024,), 512, 16384, (256, 512, 1024)) for key in PROBLEMS}
#: The tables of the quick run (``--logprobs-tables all`` adds distillation from logits).
QUICK_TABLES = ("logprobs", "distill_hidden")
FULL = {
    "logprobs": Shapes((4096,), 1024, 32768, (1024, 2048, 4096)),
    "distill_hidden": Shapes((1024, 2048), 1024, 32768, (512, 1024, 2048)),
    "distill_logits": Shapes((4096,), 1024, 32768, (1024, 2048, 4096)),
}


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def _names(text: str, known: Any, flag: str) -> Optional[set[str]]:
    if text == "all":
        return None
    names = {s.strip() for s in text.split(",") if s.strip()}
    unknown = names - set(known)
    if unknown:
        raise SystemExit(f"{flag}: unknown {sorted(unknown)}; expected some of {sorted(known)} or 'all'")
    return names


def resolve_shapes(args: argparse.Namespace) -> dict[str, Shapes]:
    """The shapes of every wanted problem: the quick or full defaults, then the flags' overrides."""
    full = args.logprobs_full or is_full(args)
    tables = args.logprobs_tables or ("all" if full else ",".join(QUICK_TABLES))
    wanted = _names(tables, PROBLEMS, "--logprobs-tables")
    given = {"ns": args.logprobs_n and _ints(args.logprobs_n), "h": args.logprobs_h, "v": args.logprobs_v,
             "sweep": args.logprobs_sweep and _ints(args.logprobs_sweep)}
    changes = {field: value for field, value in given.items() if value}
    defaults = FULL if full else QUICK
    return {k: dataclasses.replace(s, **changes) for k, s in defaults.items() if wanted is None or k in wanted}


def count(args: argparse.Namespace) -> int:
    """Progress steps: one per variant (available or not), table and sweep point."""
    steps = 0
    for key, shapes in resolve_shapes(args).items():
        points = set(shapes.ns) | (set(shapes.sweep) if sweeps(args) else set())
        steps += len(PROBLEMS[key].variants) * len(points)
    return steps


def add_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--logprobs-n", help="comma-separated token counts N, one table each (default 1024; "
                                            "full: 4096, and 1024,2048 for distillation from hidden states)")
    group.add_argument("--logprobs-h", type=int, help="hidden size H (default 512; full: 1024)")
    group.add_argument("--logprobs-v", type=int, help="vocabulary size V (default 16384; full: 32768)")
    group.add_argument("--logprobs-dtype", choices=sorted(DTYPES),
                       help="dtype of hidden states, weights and logits (default: bf16 on CUDA and on CPUs with "
                            "bf16 matrix units, else fp32)")
    group.add_argument("--logprobs-full", action="store_true",
                       help="the target shapes (H=1024, V=32768; see the section's docs; implied by --full); "
                            "minutes on a CPU")
    group.add_argument("--logprobs-sweep", help="token counts N for the --plot sweep (default 256,512,1024; "
                                                "full: 1024,2048,4096, and 512,1024,2048 from hidden states)")
    group.add_argument("--logprobs-temperature", type=float, default=1.0, help="softmax temperature T")
    group.add_argument("--logprobs-repeats", type=int, default=1, help="timed steps per variant (median)")
    group.add_argument("--logprobs-tables",
                       help=f"comma-separated subset of {','.join(PROBLEMS)}, or all (default "
                            f"{','.join(QUICK_TABLES)}; --full: all)")
    group.add_argument("--logprobs-variants", default="all",
                       help="comma-separated subset of variant names (the baseline always runs; default all)")


def dtypes(args: argparse.Namespace) -> dict[str, DtypeChoice]:
    """The section's dtype and why: ``--logprobs-dtype``, else ``--dtype``, else the host's default
    (for matmuls: two of the three tables project hidden states)."""
    return {"logprobs": choose(args, "--logprobs-dtype", matmuls=True)}


def measure_variants(key: str, n: int, shapes: Shapes, args: argparse.Namespace,
                     tick: Callable[[str], None]) -> tuple[dict[str, Measurement], dict[str, str]]:
    """Every wanted, available variant of ``PROBLEMS[key]`` at ``N=n``, each in its own process;
    and ``name -> reason`` for those left out because a peer or entry point is missing."""
    problem = PROBLEMS[key]
    wanted = _names(args.logprobs_variants, {v for p in PROBLEMS.values() for v in p.variants}, "--logprobs-variants")
    results: dict[str, Measurement] = {}
    omitted: dict[str, str] = {}
    for name, (impl, available) in problem.variants.items():
        if wanted is not None and name not in wanted and name != BASELINE:
            continue
        reason = available(args.device)
        if reason:
            omitted[name] = reason
            continue
        tick(f"logprobs {key} {impl} N={n}")
        kwargs = {"n": n, "h": shapes.h, "v": shapes.v, "dtype": args.logprobs_dtype, "impl": impl,
                  "temperature": args.logprobs_temperature}
        results[name] = measure(problem.setup, kwargs, device=args.device, repeats=args.logprobs_repeats)
    return results, omitted


def _table(key: str, n: int, shapes: Shapes, results: dict[str, Measurement], omitted: dict[str, str],
           args: argparse.Namespace) -> Table:
    problem = PROBLEMS[key]
    shape = f"N={n} H={shapes.h} V={shapes.v}" if problem.hidden else f"N={n} V={shapes.v}"
    base = results[BASELINE]
    compiled = results.get(COMPILED, Measurement())
    rows = [
        [name, m.ms, ratio(m.seconds, base.seconds), ratio(m.seconds, compiled.seconds), m.peak_mib,
         ratio(m.peak_extra_bytes, base.peak_extra_bytes), ratio(m.peak_extra_bytes, compiled.peak_extra_bytes),
         m.error or "ok"]
        for name, m in results.items()
    ]
    mem_how = "CUDA max_memory_allocated" if args.device.startswith("cuda") else "peak RSS of a child process"
    flags = ["--logprobs-tables", key, "--logprobs-n", str(n), "--logprobs-v", str(shapes.v)]
    flags += ["--logprobs-h", str(shapes.h)] if problem.hidden else []
    flags += ["--logprobs-dtype", args.logprobs_dtype, "--logprobs-temperature", str(args.logprobs_temperature),
              "--logprobs-repeats", str(args.logprobs_repeats), "--device", args.device]
    return Table(
        title=f"{problem.title}, forward+backward, {shape} {args.logprobs_dtype} on {args.device}",
        columns=["variant", "time (ms)", "x baseline", "x compiled", "peak extra (MiB)", "x baseline",
                 "x compiled", "status"],
        rows=rows,
        baseline=f"{BASELINE}: {problem.formula}; 'x compiled' is against the same under torch.compile",
        notes=[f"{name}: not measured, {reason}" for name, reason in omitted.items()]
        + [f"peak extra memory = {mem_how} above the inputs during the step; the gradients count",
           f"dtype {args.logprobs_dtype}: {args.logprobs_dtype_reason}"],
        command="python -m bench --only logprobs " + " ".join(shlex.quote(a) for a in flags),
        spread=spreads(results),
    )


def run(args: argparse.Namespace, tick: Callable[[str], None]) -> Section:
    choice = dtypes(args)["logprobs"]
    args = override(args, logprobs_dtype=choice.dtype, logprobs_dtype_reason=choice.reason)
    plan = resolve_shapes(args)
    tables = []
    data: dict[str, Any] = {"dtype": args.logprobs_dtype, "dtype_choice": choice.to_json(), "device": args.device,
                            "temperature": args.logprobs_temperature, "problems": {}}
    for key, shapes in plan.items():
        measured: dict[int, dict[str, Measurement]] = {}
        omitted: dict[str, str] = {}
        for n in shapes.ns:
            measured[n], omitted = measure_variants(key, n, shapes, args, tick)
            tables.append(_table(key, n, shapes, measured[n], omitted, args))
        entry: dict[str, Any] = {"h": shapes.h, "v": shapes.v, "omitted": omitted,
                                 "results": {n: {k: vars(m) for k, m in r.items()} for n, r in measured.items()}}
        if sweeps(args):
            for n in shapes.sweep:
                if n not in measured:
                    measured[n], _ = measure_variants(key, n, shapes, args, tick)
            entry["sweep"] = {n: {k: vars(m) for k, m in measured[n].items()} for n in shapes.sweep}
        data["problems"][key] = entry
    return Section(name="functional_ce: token log-probs and distillation over the vocabulary", tables=tables,
                   data=data)


def plot(section: Section, out_dir: Path) -> list[Path]:
    """Time and peak memory against N, one line per variant, log axes: two PNGs per problem."""
    paths: list[Path] = []
    for key, entry in section.data.get("problems", {}).items():
        problem = PROBLEMS[key]
        sizes = {"H": entry["h"], "V": entry["v"]} if problem.hidden else {"V": entry["v"]}
        paths += sweep_plots(entry.get("sweep"), out_dir, stem=problem.stem, what=problem.title, sizes=sizes,
                             details=[section.data["dtype"]])
    return paths
