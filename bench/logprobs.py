"""``logprobs`` section: per-token losses over the vocabulary, forward + backward, against the
full-logits path, ``torch.compile`` and TRL's chunked kernels.

Each variant runs in its own process (:mod:`bench.measure`), side by side in one run: time and
peak extra memory, and their ratios against the eager baseline and against it compiled. A variant
whose optional peer or ``functional_ce`` entry point is missing is left out with a note.

Table "token log-probs with entropy from hidden states" (the GRPO / PPO policy term): hidden
``[N, H]`` and weight ``[V, H]`` (both require grad) in ``--logprobs-dtype`` (bf16 default),
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

Shapes: the default run is quick (N=1024, H=512, V=16384). ``--logprobs-full`` runs the target
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
import math
import shlex
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from packaging.version import Version

from .measure import Measurement, measure
from .modes import is_full, sweeps
from .plots import sweep_plots
from .report import Section, Table, ratio, spreads

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
BASELINE = "eager full path (TRL formulas)"
COMPILED = "the same under torch.compile"
BETA = 0.5
ENTROPY_COEF = 0.01
#: Vocabulary columns per tile in TRL's trainer (``trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE``).
TRL_VOCAB_CHUNK = 32768


# --- the eager formulas -----------------------------------------------------------------------

def logprobs_and_entropy(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 logits ``[N, V]`` (already divided by the temperature), int labels ``[N]`` ->
    ``(logp, entropy)``, fp32 ``[N]``: the label's log-probability and the entropy per token."""
    logp_all = F.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, labels[:, None]).squeeze(-1)
    entropy = -(F.softmax(logits, dim=-1) * logp_all).sum(-1)
    return logp, entropy


def generalized_jsd(student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float = BETA) -> torch.Tensor:
    """fp32 student and teacher logits ``[N, V]`` (already divided by the temperature) -> fp32
    scalar: ``beta * KL(t || m) + (1 - beta) * KL(s || m)`` summed over V, mean over tokens,
    with the mixture ``m = beta * p_t + (1 - beta) * p_s``; ``0 < beta < 1``."""
    s = F.log_softmax(student_logits, dim=-1)
    t = F.log_softmax(teacher_logits, dim=-1)
    m = torch.logsumexp(torch.stack([s + math.log(1 - beta), t + math.log(beta)]), dim=0)
    kl_t = F.kl_div(m, t, reduction="none", log_target=True).sum(-1)
    kl_s = F.kl_div(m, s, reduction="none", log_target=True).sum(-1)
    return (beta * kl_t + (1 - beta) * kl_s).mean()


# --- setups: build inputs, return one forward + backward ------------------------------------

def _projection(n: int, h: int, v: int, dtype: str, device: str, *, seed: int,
                grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden ``[n, h]`` and weight ``[v, h]`` in ``dtype``; logits of standard deviation ~2."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(device=device, dtype=DTYPES[dtype])
    weight = (torch.randn(v, h, generator=g) * (2.0 / h**0.5)).to(device=device, dtype=DTYPES[dtype])
    return hidden.requires_grad_(grad), weight.requires_grad_(grad)


def _step(loss_fn: Callable[[], torch.Tensor], params: tuple[torch.Tensor, ...]) -> Callable[[], None]:
    def step() -> None:
        loss_fn().backward()
        for p in params:
            p.grad = None

    return step


def _full_path(impl: str, full: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor, ...],
               params: tuple[torch.Tensor, ...]) -> Callable[[], None]:
    """The step of ``full(*inputs)``, eager or under ``torch.compile``."""
    if impl not in ("eager", "compiled"):
        raise ValueError(f'impl must be "eager", "compiled", "trl", "liger" or "ours", got {impl!r}')
    fn = torch.compile(full) if impl == "compiled" else full
    return _step(lambda: fn(*inputs), params)


def setup_logprobs(*, n: int, h: int, v: int, dtype: str, device: str, impl: str, temperature: float = 1.0,
                   **_: Any) -> Callable[[], None]:
    """Policy-gradient step on token log-probs and entropy from hidden ``[n, h]`` x weight ``[v, h]``."""
    hidden, weight = _projection(n, h, v, dtype, device, seed=0, grad=True)
    g = torch.Generator(device="cpu").manual_seed(1)
    labels = torch.randint(0, v, (n,), generator=g).to(device)
    adv = torch.randn(n, generator=g).to(device)

    def policy(logp: torch.Tensor, entropy: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        return -(a * logp).sum() - ENTROPY_COEF * entropy.sum()

    if impl == "trl":
        from trl.kernels.chunked_logprob import ChunkedLogProbFunction

        def trl_loss() -> torch.Tensor:
            logp, entropy, *_ = ChunkedLogProbFunction.apply(
                hidden, weight, None, labels, temperature, TRL_VOCAB_CHUNK, None, 1.0, ("entropy",))
            return policy(logp, entropy, adv)

        return _step(trl_loss, (hidden, weight))
    if impl == "ours":
        import functional_ce

        return _step(lambda: policy(*functional_ce.linear_token_logprobs(
            hidden, weight, labels, temperature=temperature, return_entropy=True), adv), (hidden, weight))

    def full(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        return policy(*logprobs_and_entropy(F.linear(x, w).float() / temperature, y), a)

    return _full_path(impl, full, (hidden, weight, labels, adv), (hidden, weight))


def setup_distill_hidden(*, n: int, h: int, v: int, dtype: str, device: str, impl: str,
                         temperature: float = 1.0, **_: Any) -> Callable[[], None]:
    """Generalized JSD from student ``[n, h] x [v, h]`` (trained) and teacher ``[n, h] x [v, h]`` (frozen)."""
    s_hidden, s_weight = _projection(n, h, v, dtype, device, seed=0, grad=True)
    t_hidden, t_weight = _projection(n, h, v, dtype, device, seed=2, grad=False)
    params = (s_hidden, s_weight)
    if impl == "trl":
        from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

        return _step(lambda: ChunkedDivergenceFunction.apply(
            s_hidden, s_weight, None, t_hidden, t_weight, None, BETA, temperature)[0].mean(), params)
    if impl == "ours":
        import functional_ce

        return _step(lambda: functional_ce.linear_distillation_loss(
            s_hidden, s_weight, t_hidden, t_weight, beta=BETA, temperature=temperature), params)
    if impl == "liger":
        from liger_kernel.transformers import LigerFusedLinearJSD

        jsd = LigerFusedLinearJSD(jsd_beta=BETA, temperature=temperature)  # mean over tokens, as the others
        return _step(lambda: jsd(s_hidden, s_weight, t_hidden, t_weight), params)

    def full(sh: torch.Tensor, sw: torch.Tensor, th: torch.Tensor, tw: torch.Tensor) -> torch.Tensor:
        return generalized_jsd(F.linear(sh, sw).float() / temperature, F.linear(th, tw).float() / temperature)

    return _full_path(impl, full, (s_hidden, s_weight, t_hidden, t_weight), params)


def setup_distill_logits(*, n: int, v: int, dtype: str, device: str, impl: str, temperature: float = 1.0,
                         **_: Any) -> Callable[[], None]:
    """Generalized JSD from student logits ``[n, v]`` (trained) and teacher logits ``[n, v]``."""
    g = torch.Generator(device="cpu").manual_seed(0)
    student = (torch.randn(n, v, generator=g) * 2).to(device=device, dtype=DTYPES[dtype]).requires_grad_()
    teacher = (torch.randn(n, v, generator=g) * 2).to(device=device, dtype=DTYPES[dtype])
    if impl == "ours":
        import functional_ce

        return _step(lambda: functional_ce.distillation_loss(student, teacher, beta=BETA, temperature=temperature),
                     (student,))

    def full(s: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return generalized_jsd(s.float() / temperature, t.float() / temperature)

    return _full_path(impl, full, (student, teacher), (student,))


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
    """One loss: setup ``"module:function"``, variants ``name -> (impl, availability)`` (the first
    the baseline), whether its inputs are hidden states, plot file stem, the baseline's formula."""

    title: str
    setup: str
    variants: dict[str, tuple[str, Callable[[str], Optional[str]]]]
    hidden: bool
    stem: str
    formula: str


PROBLEMS = {
    "logprobs": Problem(
        "token log-probs with entropy from hidden states", "bench.logprobs:setup_logprobs",
        {BASELINE: ("eager", _always), COMPILED: ("compiled", _always),
         "TRL ChunkedLogProbFunction": ("trl", _trl_available),
         "functional_ce.linear_token_logprobs": ("ours", _ours_available("linear_token_logprobs"))},
        True, "logprobs_hidden",
        "z = F.linear(hidden, weight).float() / T; logp = log_softmax(z)[label]; entropy = "
        "-(softmax(z) * log_softmax(z)).sum(-1); loss = -(adv * logp).sum() - 0.01 * entropy.sum()"),
    "distill_hidden": Problem(
        "distillation, generalized JSD (beta=0.5) from hidden states", "bench.logprobs:setup_distill_hidden",
        {BASELINE: ("eager", _always), COMPILED: ("compiled", _always),
         "TRL ChunkedDivergenceFunction": ("trl", _trl_available),
         "liger LigerFusedLinearJSD (CUDA)": ("liger", _liger_available),
         "functional_ce.linear_distillation_loss": ("ours", _ours_available("linear_distillation_loss"))},
        True, "distill_hidden",
        "student and teacher logits through F.linear, .float() / T, log_softmax each; TRL GKD's "
        "beta * KL(t||m) + (1 - beta) * KL(s||m) summed over V, mean over tokens; teacher without grad"),
    "distill_logits": Problem(
        "distillation, generalized JSD (beta=0.5) from logits", "bench.logprobs:setup_distill_logits",
        {BASELINE: ("eager", _always), COMPILED: ("compiled", _always),
         "functional_ce.distillation_loss": ("ours", _ours_available("distillation_loss"))},
        False, "distill_logits",
        "student_logits.float() / T and teacher_logits.float() / T, log_softmax each; TRL GKD's "
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
    wanted = _names(args.logprobs_tables, PROBLEMS, "--logprobs-tables")
    given = {"ns": args.logprobs_n and _ints(args.logprobs_n), "h": args.logprobs_h, "v": args.logprobs_v,
             "sweep": args.logprobs_sweep and _ints(args.logprobs_sweep)}
    changes = {field: value for field, value in given.items() if value}
    defaults = FULL if args.logprobs_full or is_full(args) else QUICK
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
    group.add_argument("--logprobs-dtype", default="bf16", choices=sorted(DTYPES))
    group.add_argument("--logprobs-full", action="store_true",
                       help="the target shapes (H=1024, V=32768; see the section's docs; implied by --full); "
                            "minutes on a CPU")
    group.add_argument("--logprobs-sweep", help="token counts N for the --plot sweep (default 256,512,1024; "
                                                "full: 1024,2048,4096, and 512,1024,2048 from hidden states)")
    group.add_argument("--logprobs-temperature", type=float, default=1.0, help="softmax temperature T")
    group.add_argument("--logprobs-repeats", type=int, default=1, help="timed steps per variant (median)")
    group.add_argument("--logprobs-tables", default="all",
                       help=f"comma-separated subset of {','.join(PROBLEMS)} (default all)")
    group.add_argument("--logprobs-variants", default="all",
                       help="comma-separated subset of variant names (the baseline always runs; default all)")


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
        + [f"peak extra memory = {mem_how} above the inputs during the step; the gradients count"],
        command="python -m bench --only logprobs " + " ".join(shlex.quote(a) for a in flags),
        spread=spreads(results),
    )


def run(args: argparse.Namespace, tick: Callable[[str], None]) -> Section:
    plan = resolve_shapes(args)
    tables = []
    data: dict[str, Any] = {"dtype": args.logprobs_dtype, "device": args.device,
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
