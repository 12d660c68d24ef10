"""Peak device memory and step time of ``offload`` against ``checkpoint`` and ``save_on_cpu`` (CUDA only).

``python -m bench.sections.ac.offload [--layers 8 --hidden 2048 --tokens 8192 --dtype bf16 --repeats 5 --json OUT]``

The model is ``layers`` residual MLP blocks (LayerNorm, ``hidden -> 4*hidden`` linear, GELU,
``4*hidden -> hidden`` linear) on ``[tokens, hidden]`` activations. Variants, each one training
step (forward, ``sum()`` loss, backward) from cleared gradients:

- ``none``: no policy;
- ``checkpoint``: ``ac_policies`` ``checkpoint`` on every block;
- ``offload``: ``ac_policies`` ``offload`` on every block (side-stream copies, prefetch);
- ``save_on_cpu``: every block's forward under ``torch.autograd.graph.save_on_cpu(pin_memory=True)``,
  written here in plain torch (the old ``offload``: synchronous copies on the compute stream).

Reported per variant: bytes allocated after forward above the model and input, the step peak
above them (``max_memory_allocated``), the median step time over ``repeats`` timed steps after
one warm-up step, and both as ratios to ``none``. Without a CUDA device it refuses (exit code 2).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from typing import Any, Optional

import torch
from torch import nn

import ac_policies
from ac_policies.offload import default_offloader

logger = logging.getLogger(__name__)

VARIANTS = ("none", "checkpoint", "offload", "save_on_cpu")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class MLPBlock(nn.Module):
    """[tokens, hidden] -> [tokens, hidden]: ``x + down(gelu(up(norm(x))))``."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class SaveOnCpu(nn.Module):
    """The reference: ``inner`` run under torch's synchronous ``save_on_cpu`` (pinned host buffers)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autograd.graph.save_on_cpu(pin_memory=True):
            return self.inner(x)


def _model(layers: int, hidden: int, dtype: torch.dtype) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(MLPBlock(hidden) for _ in range(layers))).to("cuda", dtype).train()


def _step(model: nn.Module, x: torch.Tensor, settle: bool = False) -> int:
    """One training step; returns the bytes allocated right after forward (device, above the step's start).

    ``settle``: wait for the forward's copies and release the blocks they held before reading
    the bytes after forward (for the measured step, not the timed ones).
    """
    model.zero_grad(set_to_none=False)
    start = torch.cuda.memory_allocated()
    loss = model(x).float().sum()
    if settle:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    after_forward = torch.cuda.memory_allocated() - start
    loss.backward()
    return after_forward


def measure(variant: str, model: nn.Sequential, x: torch.Tensor, repeats: int) -> dict[str, float]:
    """``{"kept": bytes after forward, "peak": step peak bytes, "ms": median step ms}`` above model + input + grads,
    with ``offloaded`` (bytes) and ``prefetched`` (tensors) of :mod:`ac_policies.offload` in the measured step."""
    handle: Optional[ac_policies.PolicyHandle] = None
    run: nn.Module = model
    if variant in ("checkpoint", "offload"):
        handle = ac_policies.apply_policy(model, [{"match": "*", "when": lambda f, m: isinstance(m, MLPBlock), "action": variant}])
    elif variant == "save_on_cpu":
        run = nn.Sequential(*(SaveOnCpu(block) for block in model))
    try:
        _step(run, x)  # warm-up: gradients allocated, kernels chosen, side streams and pinned pools made
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        stats = default_offloader("cuda").stats
        offloaded, prefetched = stats.offloaded_bytes, stats.prefetched
        kept = _step(run, x, settle=True)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        stats = default_offloader("cuda").stats
        offloaded, prefetched = stats.offloaded_bytes - offloaded, stats.prefetched - prefetched
        times = []
        for _ in range(repeats):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            _step(run, x)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
    finally:
        if handle is not None:
            handle.remove()
    return {"kept": float(kept), "peak": float(peak), "ms": statistics.median(times),
            "offloaded": float(offloaded), "prefetched": float(prefetched)}


def table(results: dict[str, dict[str, float]]) -> str:
    """A markdown table of ``results`` (variant -> measure's dict), ratios against ``none``."""
    ref = results["none"]
    lines = [
        "| variant | kept after forward (MiB) | step peak (MiB) | peak x none | step (ms) | time x none | offloaded (MiB) | prefetched |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, r in results.items():
        lines.append(
            f"| {name} | {r['kept'] / 2**20:.1f} | {r['peak'] / 2**20:.1f} | {r['peak'] / ref['peak']:.2f} "
            f"| {r['ms']:.2f} | {r['ms'] / ref['ms']:.2f} | {r['offloaded'] / 2**20:.1f} | {r['prefetched']:.0f} |"
        )
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.sections.ac.offload", description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, from " + ", ".join(VARIANTS))
    parser.add_argument("--json", default=None, help="write the results here as JSON")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.sections.ac.offload: needs a CUDA device (offload moves device memory to the host); nothing measured", file=sys.stderr)
        return 2
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    if "none" not in variants:
        variants.insert(0, "none")
    model = _model(args.layers, args.hidden, DTYPES[args.dtype])
    x = torch.randn(args.tokens, args.hidden, device="cuda", dtype=DTYPES[args.dtype])
    print(f"{torch.cuda.get_device_name()}: {args.layers} MLP blocks, [{args.tokens}, {args.hidden}] {args.dtype}, "
          f"median of {args.repeats} steps", flush=True)
    results: dict[str, dict[str, float]] = {}
    for variant in variants:
        results[variant] = measure(variant, model, x, args.repeats)
        print(f"  {variant}: {results[variant]}", flush=True)
    print(table(results))
    if args.json:
        shape: dict[str, Any] = {k: getattr(args, k) for k in ("layers", "hidden", "tokens", "dtype", "repeats")}
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "shape": shape, "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
