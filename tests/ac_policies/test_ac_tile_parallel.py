"""``tile`` under FSDP2 and DTensor tensor parallelism, on 2 gloo processes (one process group for
the module): gradients equal the untiled model's, and FSDP2 reduces each gradient once per step
(the same collectives as untiled, not once per tile)."""

from __future__ import annotations

import pytest
import torch

from bench.harness.dist_pool import dist_pool_fixture
from tests.ac_policies.workers import tile_parallel as tasks

pool = dist_pool_fixture(2)


def _same(untiled, tiled):
    loss0, grads0, _ = untiled
    loss1, grads1, _ = tiled
    torch.testing.assert_close(loss1, loss0, rtol=1e-6, atol=1e-6)
    assert grads1.keys() == grads0.keys()
    for name in grads0:
        torch.testing.assert_close(grads1[name], grads0[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("policy", ["tiled", "tiled_in_full"])
def test_fsdp2_gradients_and_collectives_equal_untiled(pool, policy):
    for r in pool.run(tasks.fsdp_step, (2,), policy):
        _same(r["untiled"], r["tiled"])
        untiled_calls, tiled_calls = r["untiled"][2], r["tiled"][2]
        assert any("reduce_scatter" in op for op in tiled_calls), tiled_calls
        assert tiled_calls == untiled_calls


def test_tensor_parallel_gradients_equal_untiled(pool):
    for r in pool.run(tasks.tp_step, (2,)):
        _same(r["untiled"], r["tiled"])
