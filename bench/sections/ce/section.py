"""``ce`` section: cross-entropy from logits, forward + backward, against torch and peers.

Variants (each measured in its own process, side by side in one run):
  - ``torch eager``: ``F.cross_entropy(logits.float(), labels)``, the baseline;
  - ``torch compiled``: the same under ``torch.compile``;
  - ``functional_ce``: :func:`functional_ce.cross_entropy`;
  - ``functional_ce inplace``: the same with ``inplace_grad=True``;
  - ``liger``: Liger-Kernel's cross-entropy (CUDA only, where installed).

Shapes: the quick run measures [1024, 128256]; ``--full`` the time target [2048, 128256], the
memory target [4096, 128256] and the N sweep; ``--ce-shape`` (one or more ``N,V`` separated by ``;``) overrides.

Dtype: bf16 by default on every host (no matmuls here; :mod:`bench.harness.host_dtype`); ``--ce-dtype``
or ``--dtype`` choose another.
"""

from __future__ import annotations

import argparse
import importlib.util
import shlex
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from bench.harness.host_dtype import DtypeChoice, choose
from bench.harness.measure import Measurement, measure
from bench.harness.modes import override, per_shape, shape_list, sweeps
from bench.harness.plots import sweep_plots
from bench.harness.report import Section, Table, ratio, spreads

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
BASELINE = "torch eager"


def _inputs(n: int, v: int, dtype: str, device: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cpu").manual_seed(seed)
    logits = (torch.randn(n, v, generator=g) * 2).to(device=device, dtype=DTYPES[dtype])
    labels = torch.randint(0, v, (n,), generator=g).to(device)
    return logits.requires_grad_(), labels


def _step(logits: torch.Tensor, loss_fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], None]:
    def step() -> None:
        loss_fn(logits).backward()
        logits.grad = None

    return step


def setup_torch(*, n: int, v: int, dtype: str, device: str, compiled: bool = False, **_: Any) -> Callable[[], None]:
    logits, labels = _inputs(n, v, dtype, device)

    def loss(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(x.float(), labels)

    return _step(logits, torch.compile(loss) if compiled else loss)


def setup_ours(*, n: int, v: int, dtype: str, device: str, inplace: bool = False, chunk_size: Any = "auto",
               **_: Any) -> Callable[[], None]:
    import functional_ce

    logits, labels = _inputs(n, v, dtype, device)
    if inplace:
        # Each step overwrites the logits with their gradient and the next step reads those
        # values: the work does not depend on them, and no refill copy pollutes the timing.
        return _step(logits, lambda x: functional_ce.cross_entropy(x, labels, chunk_size=chunk_size, inplace_grad=True))
    return _step(logits, lambda x: functional_ce.cross_entropy(x, labels, chunk_size=chunk_size))


def setup_liger(*, n: int, v: int, dtype: str, device: str, **_: Any) -> Callable[[], None]:
    from liger_kernel.transformers import LigerCrossEntropyLoss

    logits, labels = _inputs(n, v, dtype, device)
    fn = LigerCrossEntropyLoss(reduction="sum")
    return _step(logits, lambda x: fn(x, labels))


# name -> (setup, extra kwargs, availability check returning a reason or None)
def _needs_cuda_and(pkg: str) -> Callable[[str], Optional[str]]:
    def check(device: str) -> Optional[str]:
        if importlib.util.find_spec(pkg) is None:
            return "not installed"
        return None if device.startswith("cuda") else "CUDA only"

    return check


VARIANTS: dict[str, tuple[Callable[..., Callable[[], None]], dict[str, Any], Callable[[str], Optional[str]]]] = {
    "torch eager": (setup_torch, {}, lambda d: None),
    "torch compiled": (setup_torch, {"compiled": True}, lambda d: None),
    "functional_ce": (setup_ours, {}, lambda d: None),
    "functional_ce inplace": (setup_ours, {"inplace": True}, lambda d: None),
    "liger (CUDA)": (setup_liger, {}, _needs_cuda_and("liger_kernel")),
}


def add_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--ce-shape", help=f"N,V of the logits, several separated by ';' (default {QUICK_SHAPES[0]}; "
                                          f"--full: {';'.join(FULL_SHAPES)})")
    group.add_argument("--ce-dtype", choices=sorted(DTYPES),
                       help="logits dtype (default bf16 on every host: no matmuls in this section)")
    group.add_argument("--ce-chunk-size", default="auto", help='rows per chunk, "auto" or "none"')
    group.add_argument("--ce-repeats", type=int, default=2, help="timed steps per variant (median)")
    group.add_argument("--ce-sweep", default="256,512,1024,2048",
                       help="token counts N for the --plot sweep (V from --ce-shape)")


QUICK_SHAPES = ["1024,128256"]
#: The time target and the memory target of bench/RESULTS.md.
FULL_SHAPES = ["2048,128256", "4096,128256"]


def shapes(args: argparse.Namespace) -> list[str]:
    return shape_list(args, args.ce_shape, QUICK_SHAPES, FULL_SHAPES)


def count(args: argparse.Namespace) -> int:
    """Progress steps: one per variant and shape, and per variant and N of the sweep."""
    sweep = len(args.ce_sweep.split(",")) if sweeps(args) else 0
    return len(VARIANTS) * (len(shapes(args)) + sweep)


def dtypes(args: argparse.Namespace) -> dict[str, DtypeChoice]:
    """The section's dtype and why: ``--ce-dtype``, else ``--dtype``, else the host's default."""
    return {"ce": choose(args, "--ce-dtype", matmuls=False)}


def _chunk(arg: str) -> Any:
    return None if arg.lower() == "none" else (arg if arg == "auto" else int(arg))


def measure_variants(n: int, v: int, args: argparse.Namespace, tick: Callable[[str], None]) -> dict[str, Measurement]:
    out = {}
    for name, (setup, extra, available) in VARIANTS.items():
        reason = available(args.device)
        tick(f"ce {name} N={n}")
        if reason:
            out[name] = Measurement(error=reason)
            continue
        kwargs = {"n": n, "v": v, "dtype": args.ce_dtype, "chunk_size": _chunk(args.ce_chunk_size), **extra}
        out[name] = measure(setup, kwargs, device=args.device, repeats=args.ce_repeats)
    return out


def _command(args: argparse.Namespace, shape: str) -> str:
    return "python -m bench --only ce " + " ".join(
        shlex.quote(a) for a in ["--ce-shape", shape, "--ce-dtype", args.ce_dtype,
                                 "--ce-chunk-size", args.ce_chunk_size, "--device", args.device]
    )


def run(args: argparse.Namespace, tick: Callable[[str], None]) -> Section:
    choice = dtypes(args)["ce"]
    args = override(args, ce_dtype=choice.dtype, ce_dtype_reason=choice.reason)
    tables, data = per_shape(args, "ce_shape", shapes(args), _table, tick)
    data["dtype_choice"] = choice.to_json()
    if sweeps(args):
        n, v = data["shape"]
        sweep = {}
        for sn in (int(x) for x in args.ce_sweep.split(",")):
            sweep[sn] = {k: vars(m) for k, m in measure_variants(sn, v, args, tick).items()}
        data["sweep"] = {"v": v, "by_n": sweep}
    return Section(name="functional_ce: cross-entropy from logits", tables=tables, data=data)


def _table(args: argparse.Namespace, tick: Callable[[str], None]) -> tuple[Table, dict[str, Any]]:
    n, v = (int(x) for x in args.ce_shape.split(","))
    results = measure_variants(n, v, args, tick)
    base = results[BASELINE]
    rows = []
    for name, m in results.items():
        rows.append([
            name,
            m.ms, ratio(m.seconds, base.seconds),
            m.peak_mib, ratio(m.peak_extra_bytes, base.peak_extra_bytes),
            m.error or "ok",
        ])
    mem_how = "CUDA max_memory_allocated" if args.device.startswith("cuda") else "peak RSS of a child process"
    table = Table(
        title=f"cross-entropy from logits, forward+backward, [{n}, {v}] {args.ce_dtype} on {args.device}",
        columns=["variant", "time (ms)", "x baseline", "peak extra (MiB)", "x baseline", "status"],
        rows=rows,
        baseline=f"{BASELINE}: F.cross_entropy(logits.float(), labels)",
        notes=[f"peak extra memory = {mem_how} above the inputs during the step; the logits' gradient counts",
               f"dtype {args.ce_dtype}: {args.ce_dtype_reason}"],
        command=_command(args, args.ce_shape),
        spread=spreads(results),
    )
    data: dict[str, Any] = {"shape": [n, v], "dtype": args.ce_dtype, "device": args.device,
                            "results": {k: vars(m) for k, m in results.items()}}
    return table, data


def plot(section: Section, out_dir: Path) -> list[Path]:
    """Peak memory and time against N at the first shape's V, one line per variant, log axes."""
    sweep = section.data.get("sweep") or {}
    return sweep_plots(sweep.get("by_n"), out_dir, stem="ce_logits", what="cross-entropy from logits",
                       sizes={"V": sweep.get("v")}, details=[section.data["dtype"]])
