"""``ac`` section, estimate accuracy: ``ac_policies.estimate`` (fake tensors) against the same
live-tensor accounting on the real step (``measure_step``) and against the process's resident set.

Dense, MoE and hybrid models at 32k vocabulary: no policy, presets and a table ``fit`` chose, the
stock loss and the hidden-state loss; ``--full``: every case of :data:`CASES` at sequence 1024,
quick: :data:`QUICK_CASES` at 512 (``--ac-estimate-seq`` sets the length). Every case runs in
its own fresh process (:mod:`bench.sections.ac.estimate_worker`, which defines the resident-set
measurement), so no earlier measurement's freed or cached memory sits in its baseline.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable

from bench.harness import isolated
from bench.harness.modes import is_full, pick
from bench.harness.report import Table, ratio
from bench.harness.rss import MMAP_THRESHOLD
from bench.sections.ac import estimate_worker
from bench.sections.ac.estimate_worker import FIT_BUDGET

MIB = 2**20
#: (family, policy or "fit", hidden-state loss[, vocabulary: SIZES' otherwise])
CASES = [
    ("llama", "none", False), ("llama", "full", False), ("llama", "selective", True), ("llama", "fit", False),
    ("llama", "full", True),
    ("qwen3_moe", "none", False), ("qwen3_moe", "non_moe", True), ("qwen3_moe", "selective", False),
    ("qwen3_next", "none", False), ("qwen3_next", "full", True),
    ("llama", "long_context", True), ("qwen3_moe", "long_context", False), ("qwen3_next", "long_context", True),
    ("llama", "full", True, 151936), ("llama", "long_context", True, 151936),
]
#: A dense model under a fitted table with the stock loss; a MoE model under a preset with the hidden-state loss.
QUICK_CASES = [CASES[3], CASES[6]]
SIZES = dict(hidden_size=256, intermediate_size=1024, moe_intermediate_size=256, num_hidden_layers=2,
             num_attention_heads=8, num_key_value_heads=4, head_dim=32, vocab_size=32000,
             max_position_embeddings=4096)
#: |estimate / measured - 1| allowed: live tensors, resident set.
TARGETS = {"live": 0.10, "rss": 0.15}


def add_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--ac-estimate", choices=["on", "off"], default="on",
                       help="the estimate accuracy table, one process per case (default on)")
    group.add_argument("--ac-estimate-seq", type=int,
                       help="sequence length of the estimate accuracy table (default 512, --full 1024)")


def _on(args: argparse.Namespace) -> bool:
    return getattr(args, "ac_estimate", "on") == "on"


def _cases(args: argparse.Namespace) -> list[tuple]:
    return (CASES if is_full(args) else QUICK_CASES) if _on(args) else []


def count(args: argparse.Namespace) -> int:
    return len(_cases(args))


def run_case(family: str, policy: str, hidden_state: bool, seq: int, sizes: dict[str, Any] = SIZES,
             timeout: float = 600.0) -> dict[str, Any]:
    """One case in a fresh process (:func:`bench.sections.ac.estimate_worker.run`, :mod:`bench.harness.isolated`);
    ``{"error": ...}`` when it failed."""
    spec = {"family": family, "policy": policy, "hidden_state": hidden_state, "seq": seq, "sizes": dict(sizes)}
    try:
        return isolated.call(estimate_worker.run, spec, timeout=timeout)
    except isolated.WorkerFailed as exc:
        return {**spec, "error": str(exc)[:200]}


def run(args: argparse.Namespace, tick: Callable[[str], None]) -> tuple[list[Table], list[dict[str, Any]]]:
    if not _on(args):
        return [], []
    seq = pick(args, getattr(args, "ac_estimate_seq", None), 512, 1024)
    rows, data = [], []
    for family, policy, hidden, *vocab in _cases(args):
        tick(f"ac estimate {family} {policy}")
        sizes = {**SIZES, "vocab_size": vocab[0]} if vocab else SIZES
        r = run_case(family, policy, hidden, seq, sizes)
        data.append(r)
        loss = ("hidden-state" if hidden else "stock") + (f", vocab {vocab[0]}" if vocab else "")
        if "error" in r:
            rows.append([family, policy, loss, *[None] * 8, f"failed: {r['error']}", ""])
            continue
        rows.append([family, policy, loss, r["estimated_peak"] / MIB, r["measured_peak"] / MIB,
                     r.get("workspace", 0) / MIB,
                     ratio(r["estimated_peak"], r["measured_peak"]), r["estimated_step_extra"] / MIB,
                     r["rss_extra"] / MIB, ratio(r["estimated_step_extra"], r["rss_extra"]),
                     sum(r["seconds"].values()), r["peak_phase"], r["peak_module"]])
    sizes = SIZES
    table = Table(
        title=f"estimate (fake tensors) vs measured step peak, seq {seq}, AdamW, 1 process, each case its own process",
        columns=["family", "policy", "loss", "estimated peak (MiB)", "measured live peak (MiB)",
                 "loss chunk workspace (MiB)", "x measured",
                 "estimated above params+opt (MiB)", "RSS peak above baseline (MiB)", "x RSS", "case (s)",
                 "peak phase", "peak module"],
        rows=rows, keys=3,
        baseline="measured: the same live-tensor accounting on the real step; RSS: a plain real step",
        notes=[f"models: hidden {sizes['hidden_size']}, {sizes['num_hidden_layers']} layers, "
               f"{sizes['num_attention_heads']}x{sizes['head_dim']} query heads, {sizes['num_key_value_heads']} KV "
               f"heads, MLP {sizes['intermediate_size']}, vocab {sizes['vocab_size']}, fp32, random init, sdpa; "
               f"MoE: 4 experts of {sizes['moe_intermediate_size']} top-2 (qwen3_moe, qwen3_next); qwen3_next "
               "alternates gated-delta-net and full attention",
               "peak = parameters + buffers + optimizer state + everything ops produce alive at once over "
               "forward, backward and the AdamW (foreach) step; "
               f"fit = ac_policies.fit(..., {FIT_BUDGET}, fake=True) (with the stock loss the logits and their "
               "gradient hold most of the peak, which no policy reduces)",
               "RSS peak above baseline = VmHWM over one plain step (no dispatch mode: forward, backward, "
               "AdamW step) minus VmRSS at its start, in a fresh process per case, after a warm-up step "
               "(optimizer state, first-call effects), gradients None, gc.collect() and malloc_trim(0); "
               "compared with the estimated peak less parameters, buffers and optimizer state (resident at "
               "the baseline)",
               f"each case's process runs with MALLOC_MMAP_THRESHOLD_={MMAP_THRESHOLD}: torch's CPU allocator "
               "calls posix_memalign, so every block of 64 KiB or more is its own mapping, returned at free, "
               "and the resident set follows live bytes",
               f"targets: within {TARGETS['live']:.0%} of the live-tensor peak, {TARGETS['rss']:.0%} of the "
               "resident-set peak; case (s) = estimate + RSS steps + measured step, wall time on this machine",
               "FSDP2 (2 gloo processes) is checked in tests/ac_policies/estimate/test_estimate_fsdp.py; CUDA against "
               "max_memory_allocated in bench/sections/ac/estimate_cuda.py (bench/gpu_check.sh)"],
        command="python -m bench --only ac" + (" --full" if is_full(args) else "") + f" --ac-estimate-seq {seq}",
    )
    return [table], data
