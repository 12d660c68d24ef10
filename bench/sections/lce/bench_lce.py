"""pytest-benchmark: cross-entropy from hidden states, forward + backward, side by side with torch.

``python -m pytest bench/sections/lce/bench_lce.py --benchmark-enable`` times them; the default test
run executes each once (``--benchmark-disable``) so the benchmarks cannot rot. Variants that
this environment lacks (torch without ``F.linear_cross_entropy``, cut-cross-entropy not
installed) are skipped with the reason. The dtype is what this CPU runs fast
(:func:`bench.harness.host_dtype.default_dtype`): bf16 with bf16 matrix units, else fp32.
"""

from __future__ import annotations

import pytest

from bench.harness.host_dtype import default_dtype
from bench.sections.lce import section as ce_hidden

SHAPE = dict(n=256, h=128, v=4096, dtype=default_dtype("cpu").dtype, device="cpu")


@pytest.mark.parametrize("variant", list(ce_hidden.VARIANTS))
def test_ce_hidden_forward_backward(benchmark, variant):
    setup, extra, available = ce_hidden.VARIANTS[variant]
    reason = available(SHAPE["device"])
    if reason:
        pytest.skip(f"{variant}: {reason}")
    step = setup(**SHAPE, **extra)
    benchmark.group = f"ce_hidden {SHAPE['n']}x{SHAPE['h']}x{SHAPE['v']} {SHAPE['dtype']}"
    benchmark.pedantic(step, warmup_rounds=1, rounds=5, iterations=1)
