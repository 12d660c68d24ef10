"""TRL's own fused-head kernel and chunked divergence against the same calls routed through
functional_ce by ``model_patches.enable_trl_heads``, side by side in one run.

Each variant runs in its own process (:func:`bench.harness.measure.measure`): time per forward +
backward step and peak extra memory. Head: hidden ``[N, H]`` and weight ``[V, H]`` (both
require grad), labels ``[N]``, called as TRL's trainers call ``_ChunkedLogProbFunction.apply``
(vocabulary tile 32768) with ``outputs`` GRPO's ``("log_probs", "entropy")`` and the DPO set
``("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")``; loss
``-(adv * logp).sum() - 0.01 * entropy.sum()``. Divergence: ``_chunked_divergence_loss`` as
DistillationTrainer calls it (beta 0.5, teacher without grad, every position counted). Skipped
when TRL (>= 1.16) is absent. fp32 on every host unless ``--trl-dtype`` or ``--dtype`` say otherwise.

    python -m bench --only trl [--full | --trl-shape N H V]   (a section of the report)
    python -m bench.sections.trl.section [--n 4096 --h 1024 --v 32768 --dtype fp32]   (a table on stdout)
"""

from __future__ import annotations

import argparse
import importlib.util
from typing import Any, Callable, Optional

import torch

from bench.harness.host_dtype import DtypeChoice, choose
from bench.harness.measure import measure
from bench.harness.modes import override
from bench.harness.report import Section, Table

GRPO = ("log_probs", "entropy")
DPO = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _routed(on: bool) -> None:
    if on:
        import model_patches

        model_patches.enable_trl_heads()  # kept for the child process's life


def setup_head(*, n: int, h: int, v: int, dtype: str, routed: bool, outputs: list[str], device: str = "cpu",
               **_: Any) -> Callable[[], None]:
    import trl.trainer.utils as trl_utils

    _routed(routed)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=g).to(DTYPES[dtype]).requires_grad_()
    weight = (torch.randn(v, h, generator=g) / h ** 0.5).to(DTYPES[dtype]).requires_grad_()
    labels, adv = torch.randint(0, v, (n,), generator=g), torch.randn(n, generator=g)

    def step() -> None:
        out = trl_utils._ChunkedLogProbFunction.apply(hidden, weight, None, labels, 1.0,
                                                      trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE, None, 1.0, tuple(outputs))
        (-(adv * out[0]).sum() - 0.01 * out[1].sum()).backward()
        hidden.grad = weight.grad = None

    return step


def setup_divergence(*, n: int, h: int, v: int, dtype: str, routed: bool, device: str = "cpu",
                     **_: Any) -> Callable[[], None]:
    import trl.trainer.distillation_trainer as dt

    _routed(routed)
    g = torch.Generator().manual_seed(0)
    d = DTYPES[dtype]
    sh = torch.randn(1, n, h, generator=g).to(d).requires_grad_()
    sw = (torch.randn(v, h, generator=g) / h ** 0.5).to(d).requires_grad_()
    th, tw = torch.randn(1, n, h, generator=g).to(d), (torch.randn(v, h, generator=g) / h ** 0.5).to(d)
    mask = torch.ones(1, n, dtype=torch.long)

    def step() -> None:
        loss, _, _ = dt._chunked_divergence_loss(sh, th, sw, tw, mask, 0.5)
        loss.backward()
        sh.grad = sw.grad = None

    return step


#: (what, setup function, extra keywords) of each measured call.
CALLS = (("head, outputs=GRPO (log_probs, entropy)", setup_head, {"outputs": list(GRPO)}),
         ("head, outputs=DPO (all five)", setup_head, {"outputs": list(DPO)}),
         ("chunked divergence, beta=0.5", setup_divergence, {}))
VARIANTS = ("TRL's own kernel", "functional_ce (enable_trl_heads)")
QUICK, FULL = dict(n=512, h=256, v=4096), dict(n=4096, h=1024, v=32768)
#: The section's dtype where no flag names one: fp32, fast on every host.
DEFAULT_DTYPE = DtypeChoice("fp32", "this section's default on every host: fp32 matmuls are fast on any CPU")


def _missing() -> Optional[str]:
    return None if importlib.util.find_spec("trl") is not None else "trl not installed (pip install 'trl>=1.16')"


def measure_calls(shape: dict[str, Any], repeats: int, tick: Callable[[str], None] = lambda _: None) -> list:
    """``(what, variant, Measurement)`` of every call, TRL's kernel then the routed one."""
    rows = []
    for what, setup, extra in CALLS:
        for routed, name in zip((False, True), VARIANTS):
            tick(f"trl: {what[:24]} {'routed' if routed else 'TRL'}")
            m = measure(setup, {**shape, **extra, "routed": routed}, repeats=repeats)
            rows.append((what, name, m))
    return rows


def add_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--trl-shape", type=int, nargs=3, metavar=("N", "H", "V"),
                       help=f"tokens, hidden size, vocabulary (default {tuple(QUICK.values())}; --full: "
                            f"{tuple(FULL.values())})")
    group.add_argument("--trl-dtype", choices=sorted(DTYPES), help="dtype of hidden states and weights "
                                                                  "(default fp32)")


def dtypes(args: argparse.Namespace) -> dict[str, DtypeChoice]:
    """The section's dtype and why: ``--trl-dtype``, else ``--dtype``, else fp32."""
    return {"trl": choose(args, "--trl-dtype", fixed=DEFAULT_DTYPE)}


def _shape(args: argparse.Namespace) -> dict[str, Any]:
    dims = args.trl_shape or tuple((FULL if args.full else QUICK).values())
    return dict(zip(("n", "h", "v"), dims), dtype=args.trl_dtype)


def count(args: argparse.Namespace) -> int:
    return 0 if _missing() else 2 * len(CALLS)


def run(args: argparse.Namespace, tick: Callable[[str], None]) -> Section:
    choice = dtypes(args)["trl"]
    shape = _shape(override(args, trl_dtype=choice.dtype))
    flags = ["--trl-shape", *(str(shape[k]) for k in "nhv"), "--trl-dtype", shape["dtype"]]
    command = "python -m bench --only trl " + " ".join(flags)
    title = f"TRL's fused head and chunked divergence, forward+backward, N={shape['n']} H={shape['h']} " \
            f"V={shape['v']} {shape['dtype']} on {args.device}"
    missing = _missing()
    if missing or args.device != "cpu":
        why = missing or "measured on CPU only so far (TRL's kernels choose their own path on CUDA)"
        return Section(name="trl", tables=[Table(title=title, columns=["call", "variant", "status"], rows=[],
                                                 command=command, notes=[f"not measured: {why}"], keys=2)],
                       data={"dtype_choice": choice.to_json()})
    rows, spread = [], {}
    base: dict[str, Any] = {}
    for what, name, m in measure_calls(shape, repeats=3, tick=tick):
        if name == VARIANTS[0]:
            base[what] = m
        b = base.get(what)
        ok = not m.error and b is not None and not b.error
        rows.append([what, name, None if m.error else round(m.ms, 1), round(m.ms / b.ms, 3) if ok else None,
                     None if m.error else round(m.peak_mib, 1),
                     round(m.peak_mib / b.peak_mib, 3) if ok and b.peak_mib else None,
                     "ok" if not m.error else f"error: {m.error}"])
        if getattr(m, "spread", None) is not None:
            spread[f"{what} / {name}"] = m.spread
    return Section(name="trl", tables=[Table(
        title=title, columns=["call", "variant", "time (ms)", "x baseline", "peak extra (MiB)", "x baseline", "status"],
        rows=rows, baseline=f"{VARIANTS[0]} (trl.trainer.utils._ChunkedLogProbFunction / _chunked_divergence_loss, "
                            "called as TRL's trainers call them)",
        notes=["routed: the same call under model_patches.enable_trl_heads(); each variant in its own process",
               "peak extra memory = the growth of the peak resident set during the timed steps",
               f"dtype {choice}"],
        command=command, keys=2, spread=spread)], data={"dtype": choice.dtype, "dtype_choice": choice.to_json()})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--h", type=int, default=1024)
    parser.add_argument("--v", type=int, default=32768)
    parser.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if _missing():
        print(f"{_missing()}: nothing measured")
        return
    shape = dict(n=args.n, h=args.h, v=args.v, dtype=args.dtype)
    rows = measure_calls(shape, args.repeats)
    print(f"N={args.n} H={args.h} V={args.v} {args.dtype}, CPU, {torch.get_num_threads()} threads")
    print(f"| {'call':42} | {'variant':33} | {'ms / step':>10} | {'peak extra MiB':>14} |")
    print(f"|{'-' * 44}|{'-' * 35}|{'-' * 12}|{'-' * 16}|")
    for what, name, m in rows:
        ms = "error: " + m.error if m.error else f"{m.ms:10.0f}"
        mib = "" if m.error else f"{m.peak_mib:14.0f}"
        print(f"| {what:42} | {name:33} | {ms:>10} | {mib:>14} |")


if __name__ == "__main__":
    main()
