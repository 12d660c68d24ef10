"""``ac_policies`` presets in the full training stack: a tiny Qwen3-MoE with the policy, per-block
``torch.compile`` and FSDP2 ``fully_shard`` on 2 gloo processes (one process group for the
module), in torchtitan's order (policy, compile, fully_shard) and in other orders.

Gradients must equal the mean over ranks of the unsharded model's without checkpointing. What a
preset recomputes is read from the compiled backward graphs: a matmul producing router logits
``[tokens, experts]`` there is the router's forward rerun by a recompute.
"""

from __future__ import annotations

import pytest
import torch

from bench.harness.dist_pool import dist_pool_fixture
from tests.ac_policies.workers import stack as tasks

#: preset -> whether the router's forward is rerun in backward (``full`` checkpoints whole
#: blocks; ``selective`` saves matmuls, the router's included; the ``non_moe`` presets leave the
#: router and experts out of every region).
ROUTER_RECOMPUTED = {"full": True, "selective": False, "non_moe": False, "non_moe_no_attn": False}


pool = dist_pool_fixture(2)


def _check(results: list[dict]) -> None:
    for r in results:
        assert r["error"] is None, r["error"]
        torch.testing.assert_close(r["loss"], r["ref_loss"], rtol=1e-6, atol=1e-6)
        assert set(r["grads"]) == set(r["ref_grads"])
        for name, grad in r["grads"].items():
            torch.testing.assert_close(grad, r["ref_grads"][name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("preset", list(ROUTER_RECOMPUTED))
def test_preset_then_per_block_compile_then_fully_shard(pool, preset):
    results = pool.run(tasks.full_stack_step, (2,), preset, "count-recomputes")
    _check(results)
    for r in results:
        assert (r["router_recomputes"] > 0) == ROUTER_RECOMPUTED[preset], r["router_recomputes"]


@pytest.mark.parametrize("order", [("compile", "policy", "shard"), ("shard", "policy", "compile")],
                         ids=["compile-first", "fully_shard-first"])
def test_other_orders_are_still_correct_and_checkpointed(pool, order):
    """The policy wraps forward methods, which compile (lazy, at the first call) and FSDP2 (hooks
    around the call) both leave in place: other orders give the same gradients and ``full``
    still reruns the router."""
    results = pool.run(tasks.full_stack_step, (2,), "full", "count-recomputes", order)
    _check(results)
    assert all(r["router_recomputes"] > 0 for r in results)


@pytest.mark.slow  # inductor compiles every block on both ranks: 35-60 s per preset on 2 cold cores
@pytest.mark.parametrize("preset", list(ROUTER_RECOMPUTED))
def test_inductor_per_block_compile_with_fully_shard(pool, preset):
    """Inductor on CPU, every preset (nightly profile)."""
    _check(pool.run(tasks.full_stack_step, (2,), preset, "inductor"))
