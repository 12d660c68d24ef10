"""TRL's own fused-head kernel and chunked divergence against the same calls routed through
functional_ce by ``model_patches.enable_trl_heads``, side by side in one run.

Each variant runs in its own process (:func:`bench.measure.measure`): time per forward +
backward step and peak extra memory. Head: hidden ``[N, H]`` and weight ``[V, H]`` (both
require grad), labels ``[N]``, called as TRL's trainers call ``_ChunkedLogProbFunction.apply``
(vocabulary tile 32768) with ``outputs`` GRPO's ``("log_probs", "entropy")`` and the DPO set
``("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")``; loss
``-(adv * logp).sum() - 0.01 * entropy.sum()``. Divergence: ``_chunked_divergence_loss`` as
DistillationTrainer calls it (beta 0.5, teacher without grad, every position counted). Skipped
when TRL (>= 1.16) is absent.

    python -m bench.trl_heads [--n 4096 --h 1024 --v 32768 --dtype fp32]
"""

from __future__ import annotations

import argparse
import importlib.util
from typing import Any, Callable

import torch

from .measure import measure

GRPO = ("log_probs", "entropy")
DPO = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--h", type=int, default=1024)
    parser.add_argument("--v", type=int, default=32768)
    parser.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if importlib.util.find_spec("trl") is None:
        print("trl not installed: section skipped (pip install 'trl>=1.16')")
        return
    shape = dict(n=args.n, h=args.h, v=args.v, dtype=args.dtype)
    rows = []
    for what, setup, extra in (("head, outputs=GRPO (log_probs, entropy)", "setup_head", {"outputs": list(GRPO)}),
                               ("head, outputs=DPO (all five)", "setup_head", {"outputs": list(DPO)}),
                               ("chunked divergence, beta=0.5", "setup_divergence", {})):
        for routed in (False, True):
            m = measure(f"bench.trl_heads:{setup}", {**shape, **extra, "routed": routed}, repeats=args.repeats)
            rows.append((what, "functional_ce (enable_trl_heads)" if routed else "TRL's own kernel", m))
    print(f"N={args.n} H={args.h} V={args.v} {args.dtype}, CPU, {torch.get_num_threads()} threads")
    print(f"| {'call':42} | {'variant':33} | {'ms / step':>10} | {'peak extra MiB':>14} |")
    print(f"|{'-' * 44}|{'-' * 35}|{'-' * 12}|{'-' * 16}|")
    for what, name, m in rows:
        ms = "error: " + m.error if m.error else f"{m.ms:10.0f}"
        mib = "" if m.error else f"{m.peak_mib:14.0f}"
        print(f"| {what:42} | {name:33} | {ms:>10} | {mib:>14} |")


if __name__ == "__main__":
    main()
