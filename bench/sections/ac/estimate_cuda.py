"""``ac_policies.estimate(..., device="cuda")`` against ``torch.cuda.max_memory_allocated`` over one
real training step (CUDA only; step 10 of ``bench/gpu_check.sh``).

``python -m bench.sections.ac.estimate_cuda --out DIR [--seq 4096] [--cases llama:none:stock,...]``

Per case (:data:`CASES`: dense without a policy, dense with the hidden-state loss and ``full``,
MoE with ``non_moe``), on a bf16 model of :data:`SIZES` at batch 1 x ``seq`` tokens:

- estimate: ``ac_policies.estimate(model, step, device="cuda")`` (fake tensors, each storage
  rounded up to 512 bytes as the caching allocator rounds a request);
- measured: the estimate's optimizer (AdamW, foreach) runs one warm-up step (its state, cuBLAS
  workspaces, first-call allocations), gradients are set to None, the peak statistics are reset,
  then one step (forward, backward, optimizer step): ``max_memory_allocated()``, absolute (what the
  estimate's ``peak`` models: parameters, buffers and optimizer state included), and less
  ``memory_allocated()`` at the step's start (next to the estimated peak less parameters, buffers
  and optimizer state).

Prints one line per case and writes ``DIR/ac_estimate_cuda.json``. Target: the estimated peak
within 5% of ``max_memory_allocated``. Without a CUDA device it refuses (exit code 2).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import warnings
from typing import Any, Optional

import torch

from bench.sections.ac.estimate_worker import build, make_step, plain_step

#: (family, policy, hidden-state loss)
CASES = [("llama", "none", False), ("llama", "full", True), ("qwen3_moe", "non_moe", False)]
SIZES = dict(hidden_size=1024, intermediate_size=4096, moe_intermediate_size=1024, num_hidden_layers=4,
             num_attention_heads=16, num_key_value_heads=8, head_dim=64, vocab_size=32000,
             max_position_embeddings=8192)
TARGET = 0.05
MIB = 2**20


def check_case(family: str, policy: str, hidden_state: bool, seq: int,
               sizes: dict[str, Any] = SIZES) -> dict[str, Any]:
    """Estimate and measure one case on the current CUDA device (see the module's docs)."""
    import ac_policies
    import model_patches

    model = build(family, sizes).to(device="cuda", dtype=torch.bfloat16)
    step = make_step(model.config.vocab_size, seq)
    handles = [model_patches.enable_linear_cross_entropy(model)] if hidden_state else []
    if policy != "none":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ac_policies.ACPolicyWarning)
            handles.append(ac_policies.apply_policy(model, policy))
    est = ac_policies.estimate(model, step, device="cuda")
    one = plain_step(model, step)
    one()
    model.zero_grad(set_to_none=True)
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    one()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    held = est.params + est.buffers + est.optimizer
    result = {"family": family, "policy": policy, "hidden_state": hidden_state, "seq": seq,
              "estimated_peak": est.peak, "max_memory_allocated": peak, "ratio": est.peak / peak,
              "estimated_step_extra": est.peak - held, "allocated_at_start": base,
              "measured_step_extra": peak - base, "extra_ratio": (est.peak - held) / max(peak - base, 1),
              "peak_phase": est.peak_phase, "peak_module": est.peak_module}
    for h in reversed(handles):
        h.remove()
    del model, one
    gc.collect()
    torch.cuda.empty_cache()
    return result


def _cases(text: Optional[str]) -> list[tuple[str, str, bool]]:
    if not text:
        return list(CASES)
    out = []
    for item in text.split(","):
        family, policy, loss = item.split(":")
        if loss not in ("stock", "hidden_state"):
            raise ValueError(f"loss must be stock or hidden_state, got {loss!r} in {item!r}")
        out.append((family, policy, loss == "hidden_state"))
    return out


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.sections.ac.estimate_cuda", description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for ac_estimate_cuda.json")
    parser.add_argument("--seq", type=int, default=4096, help="tokens per step, batch 1 (default 4096)")
    parser.add_argument("--cases", help="family:policy:stock|hidden_state, comma-separated (default: CASES)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.sections.ac.estimate_cuda: needs a CUDA device (it compares with max_memory_allocated); nothing measured",
              file=sys.stderr)
        return 2
    print(f"{torch.cuda.get_device_name()}: estimate(device='cuda') vs max_memory_allocated, bf16, "
          f"1 x {args.seq} tokens, AdamW", flush=True)
    results, ok = [], True
    for family, policy, hidden in _cases(args.cases):
        r = check_case(family, policy, hidden, args.seq)
        results.append(r)
        within = abs(r["ratio"] - 1) <= TARGET
        ok &= within
        print(f"{family:10s} {policy:9s} {'hidden_state' if hidden else 'stock':12s} "
              f"estimate {r['estimated_peak'] / MIB:9.1f} MiB  max_memory_allocated "
              f"{r['max_memory_allocated'] / MIB:9.1f} MiB  x {r['ratio']:.3f}  "
              f"(above the start: {r['estimated_step_extra'] / MIB:.1f} vs {r['measured_step_extra'] / MIB:.1f} MiB, "
              f"x {r['extra_ratio']:.3f})  {'ok' if within else 'OVER 5%'}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "ac_estimate_cuda.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "sizes": SIZES, "target": TARGET, "cases": results}, f,
                  indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
