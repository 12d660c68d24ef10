"""pytest-benchmark: cross-entropy from logits, forward + backward, side by side with torch.

``python -m pytest bench/sections/ce/bench_ce.py --benchmark-enable`` times them; the default test
run executes each once (``--benchmark-disable``) so the benchmarks cannot rot.
"""

from __future__ import annotations

import pytest

from bench.sections.ce import section as ce_logits

SHAPE = dict(n=256, v=8192, dtype="bf16", device="cpu")


@pytest.mark.parametrize("variant", ["torch eager", "torch compiled", "functional_ce", "functional_ce inplace"])
def test_ce_logits_forward_backward(benchmark, variant):
    setup, extra, available = ce_logits.VARIANTS[variant]
    step = setup(**SHAPE, **extra)
    benchmark.group = f"ce_logits {SHAPE['n']}x{SHAPE['v']} {SHAPE['dtype']}"
    benchmark.pedantic(step, warmup_rounds=1, rounds=5, iterations=1)
