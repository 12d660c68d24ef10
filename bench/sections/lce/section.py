"""``lce`` section: cross-entropy from hidden states, forward + backward, against torch and peers.

Table 1, the hidden-state loss ``[N, H] x [V, H]`` (each variant in its own process, side by
side in one run):
  - ``F.linear + F.cross_entropy eager``: ``F.cross_entropy(F.linear(h, w).float(), y)``, the baseline;
  - the same under ``torch.compile`` (what cut-cross-entropy's ``impl="torch_compile"`` runs when
    no label is ignored: the full ``[N, V]`` logits, fused by inductor);
  - ``torch F.linear_cross_entropy``: with ``options=torch.nn.LinearCrossEntropyOptions()``
    (torch's chunked path), where this torch has it;
  - ``cut-cross-entropy torch_compile``: Apple's ``linear_cross_entropy(..., impl="torch_compile")``,
    where the package is installed and importable (an optional peer, never a dependency), and on
    CUDA its own fused kernel (``impl="cce"``, the package's default there);
  - ``liger fused linear CE (CUDA)``: Liger-Kernel's ``LigerFusedLinearCrossEntropyLoss``, where
    installed: as shipped (weight gradient accumulated in the weight's dtype) and with
    ``accum_dtype=torch.float32`` (fp32 accumulation, as functional_ce always does);
  - ``functional_ce.linear_cross_entropy``, the default (gradients computed in forward) and with
    ``recompute_logits_in_backward=True``.

Table 2, the Hugging Face loss path (:mod:`bench.sections.lce.hf_models`): a tiny Llama's loss step as
shipped, with ``model_patches.enable_chunked_loss()``, and with ``model_patches.causal_lm_loss``.

Shapes: the quick run measures table 1 at N=1024, H=512, V=16384, 3 steps per variant; ``--full``
at the targets of bench/RESULTS.md (time N=4096, H=1024, V=32768; memory N=8192, H=2048,
V=32768), table 2 at 4 x 512, V=32000, and the N sweep. ``--lce-shape`` (``N,H,V``, several
separated by ``;``), ``--lce-repeats`` and ``--lce-hf`` override either.

Dtype (both tables): bf16 on CUDA and on CPUs with bf16 matrix units, fp32 on other CPUs, where
bf16 matmuls can run 100x slower (:mod:`bench.harness.host_dtype`); ``--lce-dtype`` or ``--dtype`` choose.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import shlex
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from bench.harness.host_dtype import DtypeChoice, choose
from bench.harness.measure import Measurement, measure
from bench.harness.modes import override, per_shape, pick, shape_list, sweeps
from bench.harness.plots import sweep_plots
from bench.harness.report import Section, Table, ratio, spreads
from bench.sections.lce.hf_models import HF_VARIANTS, measure_hf_table

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
BASELINE = "F.linear + F.cross_entropy eager"


def _inputs(n: int, h: int, v: int, dtype: str, device: str, seed: int = 0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(device=device, dtype=DTYPES[dtype]).requires_grad_()
    weight = (torch.randn(v, h, generator=g) * (2.0 / h**0.5)).to(device=device, dtype=DTYPES[dtype])
    labels = torch.randint(0, v, (n,), generator=g).to(device)
    return hidden, weight.requires_grad_(), labels


def _step(hidden: torch.Tensor, weight: torch.Tensor, loss_fn: Callable[[], torch.Tensor]) -> Callable[[], None]:
    def step() -> None:
        loss_fn().backward()
        hidden.grad = None
        weight.grad = None

    return step


def setup_eager(*, n: int, h: int, v: int, dtype: str, device: str, compiled: bool = False,
                **_: Any) -> Callable[[], None]:
    hidden, weight, labels = _inputs(n, h, v, dtype, device)
    F = torch.nn.functional

    def loss(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(F.linear(x, w).float(), y)

    fn = torch.compile(loss) if compiled else loss
    return _step(hidden, weight, lambda: fn(hidden, weight, labels))


def setup_torch_lce(*, n: int, h: int, v: int, dtype: str, device: str, **_: Any) -> Callable[[], None]:
    hidden, weight, labels = _inputs(n, h, v, dtype, device)
    opts = torch.nn.LinearCrossEntropyOptions()
    return _step(hidden, weight, lambda: torch.nn.functional.linear_cross_entropy(hidden, weight, labels, options=opts))


def setup_cce(*, n: int, h: int, v: int, dtype: str, device: str, impl: str = "torch_compile",
              **_: Any) -> Callable[[], None]:
    from cut_cross_entropy import linear_cross_entropy

    hidden, weight, labels = _inputs(n, h, v, dtype, device)
    return _step(hidden, weight, lambda: linear_cross_entropy(hidden, weight, labels, impl=impl))


def setup_ours(*, n: int, h: int, v: int, dtype: str, device: str, chunk_size: Any = "auto",
               recompute: bool = False, **_: Any) -> Callable[[], None]:
    import functional_ce

    hidden, weight, labels = _inputs(n, h, v, dtype, device)
    return _step(hidden, weight, lambda: functional_ce.linear_cross_entropy(
        hidden, weight, labels, chunk_size=chunk_size, recompute_logits_in_backward=recompute))


def setup_liger(*, n: int, h: int, v: int, dtype: str, device: str, fp32_accumulation: bool = False,
                **_: Any) -> Callable[[], None]:
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    hidden, weight, labels = _inputs(n, h, v, dtype, device)
    # Liger accumulates the weight gradient in the weight's dtype unless accum_dtype is given
    fn = LigerFusedLinearCrossEntropyLoss(accum_dtype=torch.float32) if fp32_accumulation else \
        LigerFusedLinearCrossEntropyLoss()
    return _step(hidden, weight, lambda: fn(weight, hidden, labels))


def _liger_available(device: str) -> Optional[str]:
    if importlib.util.find_spec("liger_kernel") is None:
        return "not installed"
    return None if device.startswith("cuda") else "CUDA only"


def _torch_lce_available(device: str) -> Optional[str]:
    F = torch.nn.functional
    if not hasattr(F, "linear_cross_entropy") or not hasattr(torch.nn, "LinearCrossEntropyOptions"):
        return f"not available in torch {torch.__version__}"
    return None


def _cce_available(device: str) -> Optional[str]:
    if importlib.util.find_spec("cut_cross_entropy") is None:
        return "not installed"
    try:
        importlib.import_module("cut_cross_entropy")
    except Exception as exc:  # noqa: BLE001 - e.g. it imports triton at module level
        return f"not importable ({type(exc).__name__}: {exc})"[:80]
    return None


def _cce_kernel_available(device: str) -> Optional[str]:
    return _cce_available(device) or (None if device.startswith("cuda") else "CUDA only")


COMPILED = "the same under torch.compile"
VARIANTS: dict[str, tuple[Callable[..., Callable[[], None]], dict[str, Any], Callable[[str], Optional[str]]]] = {
    BASELINE: (setup_eager, {}, lambda d: None),
    COMPILED: (setup_eager, {"compiled": True}, lambda d: None),
    "torch F.linear_cross_entropy (options)": (setup_torch_lce, {}, _torch_lce_available),
    "cut-cross-entropy torch_compile": (setup_cce, {}, _cce_available),
    "cut-cross-entropy cce kernel (CUDA)": (setup_cce, {"impl": "cce"}, _cce_kernel_available),
    "liger fused linear CE (CUDA)": (setup_liger, {}, _liger_available),
    "liger accum_dtype=float32 (CUDA)": (setup_liger, {"fp32_accumulation": True},
                                          _liger_available),
    "functional_ce.linear_cross_entropy": (setup_ours, {}, lambda d: None),
    "functional_ce (recompute_logits_in_backward=True)": (
        setup_ours, {"recompute": True}, lambda d: None),
}


def add_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--lce-shape", help="N,H,V of hidden [N, H] and weight [V, H], several separated by ';' "
                                           f"(default {QUICK_SHAPES[0]}; --full: {';'.join(FULL_SHAPES)})")
    group.add_argument("--lce-dtype", choices=sorted(DTYPES),
                       help="dtype of hidden and weight (default: bf16 on CUDA and on CPUs with bf16 matrix "
                            "units, else fp32)")
    group.add_argument("--lce-chunk-size", default="auto", help='rows per chunk, "auto" or "none"')
    group.add_argument("--lce-repeats", type=int, help="timed steps per variant (median; default 3, --full 2)")
    group.add_argument("--lce-variants", default="all",
                       help="comma-separated subset of variant names to run (default all)")
    group.add_argument("--lce-hf", help='B,T,V of the Hugging Face loss-path table, e.g. 4,512,32000 (default '
                                        f'"none": skipped, it adds about a minute; --full: {FULL_HF})')
    group.add_argument("--lce-profile", action="store_true",
                       help="add a profile of functional_ce's step at --lce-shape: matmul time vs the rest")
    group.add_argument("--lce-sweep", default="256,512,1024,2048",
                       help="token counts N for the --plot sweep (H, V from --lce-shape)")


QUICK_SHAPES = ["1024,512,16384"]
#: The time target and the memory target of bench/RESULTS.md.
FULL_SHAPES = ["4096,1024,32768", "8192,2048,32768"]
FULL_HF = "4,512,32000"


def _resolved(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with the quick or full defaults of the flags the user left unset."""
    return override(args, lce_shapes=shape_list(args, args.lce_shape, QUICK_SHAPES, FULL_SHAPES),
                    lce_repeats=pick(args, args.lce_repeats, 3, 2), lce_hf=pick(args, args.lce_hf, "none", FULL_HF),
                    lce_dtype=dtypes(args)["lce"].dtype)


def count(args: argparse.Namespace) -> int:
    """Progress steps: one per variant and shape (and sweep point), per HF variant, the profile."""
    a = _resolved(args)
    sweep = len(a.lce_sweep.split(",")) if sweeps(a) else 0
    return (len(VARIANTS) * (len(a.lce_shapes) + sweep) + (len(HF_VARIANTS) if a.lce_hf.lower() != "none" else 0)
            + bool(a.lce_profile))


def dtypes(args: argparse.Namespace) -> dict[str, DtypeChoice]:
    """The section's dtype and why: ``--lce-dtype``, else ``--dtype``, else the host's default."""
    return {"lce": choose(args, "--lce-dtype", matmuls=True)}


def _chunk(arg: str) -> Any:
    return None if arg.lower() == "none" else (arg if arg == "auto" else int(arg))


def measure_variants(n: int, h: int, v: int, args: argparse.Namespace,
                     tick: Callable[[str], None]) -> dict[str, Measurement]:
    """Every wanted variant at ``N=n``, each in its own process."""
    wanted = None if args.lce_variants == "all" else {s.strip() for s in args.lce_variants.split(",")}
    results: dict[str, Measurement] = {}
    for name, (setup, extra, available) in VARIANTS.items():
        if wanted is not None and name not in wanted and name != BASELINE:
            continue
        tick(f"lce {name} N={n}")
        reason = available(args.device)
        if reason:
            results[name] = Measurement(error=reason)
            continue
        kwargs = {"n": n, "h": h, "v": v, "dtype": args.lce_dtype, "chunk_size": _chunk(args.lce_chunk_size), **extra}
        results[name] = measure(setup, kwargs, device=args.device, repeats=args.lce_repeats)
    return results


def _lce_table(args: argparse.Namespace, tick: Callable[[str], None]) -> tuple[Table, dict[str, Any]]:
    n, h, v = (int(x) for x in args.lce_shape.split(","))
    results = measure_variants(n, h, v, args, tick)
    base = results[BASELINE]
    torch_lce = results.get("torch F.linear_cross_entropy (options)", Measurement())
    compiled = results.get(COMPILED, Measurement())
    rows = [
        [name, m.ms, ratio(m.seconds, base.seconds), ratio(m.seconds, compiled.seconds),
         ratio(m.seconds, torch_lce.seconds), m.peak_mib, ratio(m.peak_extra_bytes, base.peak_extra_bytes),
         ratio(m.peak_extra_bytes, compiled.peak_extra_bytes), m.error or "ok"]
        for name, m in results.items()
    ]
    mem_how = "CUDA max_memory_allocated" if args.device.startswith("cuda") else "peak RSS of a child process"
    cmd = "python -m bench --only lce " + " ".join(shlex.quote(a) for a in [
        "--lce-shape", args.lce_shape, "--lce-dtype", args.lce_dtype, "--lce-chunk-size", args.lce_chunk_size,
        "--lce-repeats", str(args.lce_repeats), "--lce-hf", args.lce_hf, "--device", args.device])
    table = Table(
        title=f"cross-entropy from hidden states, forward+backward, N={n} H={h} V={v} {args.lce_dtype} on {args.device}",
        columns=["variant", "time (ms)", "x baseline", "x compiled", "x torch lce", "peak extra (MiB)",
                 "x baseline", "x compiled", "status"],
        rows=rows,
        baseline=f"{BASELINE}: F.cross_entropy(F.linear(hidden, weight).float(), labels); 'x compiled' is "
                 "against the same under torch.compile, 'x torch lce' against "
                 "F.linear_cross_entropy(options=LinearCrossEntropyOptions())",
        notes=[f"peak extra memory = {mem_how} above the inputs during the step; gradients of hidden and "
               "weight count", f"dtype {args.lce_dtype}: {args.lce_dtype_reason}"],
        command=cmd,
        spread=spreads(results),
    )
    return table, {"shape": [n, h, v], "results": {k: vars(m) for k, m in results.items()}}


#: Profiler event names that are matrix multiplications (aten ops and oneDNN / cuBLAS kernels).
_MATMUL_MARKERS = ("mm", "matmul", "linear", "gemm", "brgemm")
#: GPU kernel names that are matrix multiplications (cuBLAS / cuBLASLt / CUTLASS kernels).
_GPU_MATMUL_MARKERS = ("gemm", "nvjet", "xmma", "cutlass", "cublas")


def profile_step(*, n: int, h: int, v: int, dtype: str, device: str, chunk_size: Any = "auto",
                 **_: Any) -> tuple[dict[str, float], list[tuple[str, float]]]:
    """Self time (ms) of one warm forward + backward of ``functional_ce.linear_cross_entropy``,
    split into matmuls and everything else (compiled chunk graphs, copies, reductions), and the
    ten largest events ``(name, ms)``."""
    from torch.profiler import ProfilerActivity, profile

    step = setup_ours(n=n, h=h, v=v, dtype=dtype, device=device, chunk_size=chunk_size)
    step()
    step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    with profile(activities=activities) as prof:
        step()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
    split = {"matmul": 0.0, "other": 0.0}
    cuda = device.startswith("cuda")
    events = []
    for event in prof.key_averages():
        name = event.key.lower()
        if cuda:
            # device kernels only (an aten op's self device time repeats its kernels' time)
            if event.device_type != torch.autograd.DeviceType.CUDA:
                continue
            part = "matmul" if any(m in name for m in _GPU_MATMUL_MARKERS) else "other"
            ms = event.self_device_time_total / 1e3
        else:
            part = "matmul" if any(m in name for m in _MATMUL_MARKERS) else "other"
            ms = event.self_cpu_time_total / 1e3
        split[part] += ms
        events.append((event.key[:120], ms))
    return split, sorted(events, key=lambda e: -e[1])[:10]


def _profile_table(args: argparse.Namespace, tick: Callable[[str], None]) -> tuple[Table, dict[str, Any]]:
    n, h, v = (int(x) for x in args.lce_shape.split(","))
    tick(f"lce profile N={n}")
    split, top = profile_step(n=n, h=h, v=v, dtype=args.lce_dtype, device=args.device,
                              chunk_size=_chunk(args.lce_chunk_size))
    total = sum(split.values()) or 1.0
    matmul_flop = 3 * 2 * n * h * v
    rows = [[part, ms, ms / total, (matmul_flop / (ms / 1e3) / 1e12) if part == "matmul" and ms else None]
            for part, ms in split.items()]
    table = Table(
        title=f"where functional_ce.linear_cross_entropy's step goes, N={n} H={h} V={v} {args.lce_dtype} on {args.device}",
        columns=["part", "self time (ms)", "share", "matmul TFLOP/s"],
        rows=rows,
        command="python -m bench --only lce --lce-profile " + " ".join(shlex.quote(a) for a in [
            "--lce-shape", args.lce_shape, "--lce-dtype", args.lce_dtype, "--device", args.device]),
        notes=["torch.profiler self time of one warm step in this process; matmul = events whose name holds "
               "mm/matmul/linear/gemm, on CUDA device kernels named gemm/nvjet/xmma/cutlass/cublas (3 N H V "
               "multiply-adds: logits, hidden and weight gradients)"],
    )
    return table, {"profile_ms": split, "profile_top_events_ms": top}


def run(args: argparse.Namespace, tick: Callable[[str], None]) -> Section:
    choice = dtypes(args)["lce"]
    args = override(_resolved(args), lce_dtype_reason=choice.reason)
    tables, data = per_shape(args, "lce_shape", args.lce_shapes, _lce_table, tick)
    args = override(args, lce_shape=args.lce_shapes[0])
    if args.lce_profile:
        profile_table, profile_data = _profile_table(args, tick)
        tables.append(profile_table)
        data.update(profile_data)
    if args.lce_hf.lower() != "none":
        if importlib.util.find_spec("transformers") is None:
            tables.append(Table(title="Hugging Face loss step", columns=["status"], rows=[["transformers not installed"]],
                                command="python -m bench --only lce"))
        else:
            hf_table, hf_data = measure_hf_table(args, tick)
            tables.append(hf_table)
            data.update(hf_data)
    data.update(dtype=args.lce_dtype, dtype_choice=choice.to_json(), device=args.device)
    if sweeps(args):
        _, h, v = data["shape"]
        sweep = {sn: {k: vars(m) for k, m in measure_variants(sn, h, v, args, tick).items()}
                 for sn in (int(x) for x in args.lce_sweep.split(","))}
        data["sweep"] = {"h": h, "v": v, "by_n": sweep}
    return Section(name="functional_ce: cross-entropy from hidden states", tables=tables, data=data)


def plot(section: Section, out_dir: Path) -> list[Path]:
    """Peak memory and time against N at the first shape's H and V, one line per variant, log axes."""
    sweep = section.data.get("sweep") or {}
    return sweep_plots(sweep.get("by_n"), out_dir, stem="ce_hidden", what="cross-entropy from hidden states",
                       sizes={"H": sweep.get("h"), "V": sweep.get("v")}, details=[section.data["dtype"]])
