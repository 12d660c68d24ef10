"""``estimate(world_size=2)`` against a real FSDP2 step (``fully_shard`` on each decoder block and
the root) on 2 gloo processes (one process group for the module): each process's live-tensor
step peak, measured with the same accounting (FSDP2's in-place resized all-gather storages read
after every op), within 10%; parameters, gradients and optimizer state shards exactly."""

from __future__ import annotations

import pytest

from bench.harness.dist_pool import dist_pool_fixture
from tests.ac_policies.estimate.workers import fsdp_estimate as tasks

pool = dist_pool_fixture(2)


def _check(results: list[dict]) -> None:
    for r in results:
        est, real = r["estimated"], r["measured"]
        assert (est.params, est.grads, est.optimizer) == (real.params, real.grads, real.optimizer)
        assert abs(est.peak - real.peak) <= 0.10 * real.peak, (str(est), str(real))


def test_fsdp2_estimate_matches_each_process(pool):
    _check(pool.run(tasks.fsdp_peaks, (2,), "llama", "full", True, 64))


@pytest.mark.slow
@pytest.mark.parametrize("family,policy,hidden_state", [
    ("llama", "none", False), ("qwen3_moe", "non_moe", False), ("qwen3_moe", "selective", True),
])
def test_fsdp2_estimate_other_models(pool, family, policy, hidden_state):
    _check(pool.run(tasks.fsdp_peaks, (2,), family, policy, hidden_state, 64))
