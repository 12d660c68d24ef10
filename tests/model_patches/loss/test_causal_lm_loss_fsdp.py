"""``model_patches.causal_lm_loss`` on a model sharded with FSDP2 (``fully_shard`` on each decoder
layer and the root), 2 gloo processes sharing one process group for the module.

Each process trains on its own batch. The loss must be that batch's loss, and every parameter
(the LM head included) must get FSDP2's usual gradient, the mean over processes of each
batch's gradient, computed here from an unsharded copy of the model. The root's parameters must
be gathered once in forward (as for ``model(**batch)``) and resharded after it.
"""

from __future__ import annotations

import pytest
import torch

from bench.harness.dist_pool import dist_pool_fixture
from tests.model_patches.loss.workers import fsdp as fsdp_tasks

pool = dist_pool_fixture(2)


def _check_against_reference(results: list[dict]) -> None:
    world = len(results)
    for rank, r in enumerate(results):
        assert r["is_plain"], "the loss must be this process's own plain tensor"
        torch.testing.assert_close(r["loss"], r["ref_losses"][rank], rtol=1e-5, atol=1e-6)
        expected = {name: sum(g[name] for g in r["ref_grads"]) / world for name in r["ref_grads"][0]}
        assert set(r["grads"]) == set(expected)
        for name, grad in r["grads"].items():
            torch.testing.assert_close(grad, expected[name], rtol=1e-4, atol=1e-6, msg=name)
        assert r["head_sharded_after_step"], "the LM head was left unsharded after the step"


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_fsdp2_model_gets_fsdp2_gradients_and_each_rank_its_own_loss(pool, tied):
    results = pool.run(fsdp_tasks.causal_lm_loss_step, (2,), "llama", tied, False, True)
    _check_against_reference(results)


def test_fsdp2_gathers_as_the_model_own_forward_does(pool):
    """No second gather of the LM head: the same all-gathers (count and bytes) as
    ``model(**batch)``, and one reduce-scatter per FSDP group in backward as well."""
    ours = pool.run(fsdp_tasks.causal_lm_loss_step, (2,), "llama", False, False, True)
    own = pool.run(fsdp_tasks.causal_lm_loss_step, (2,), "llama", False, False, False)
    for a, b in zip(ours, own):
        assert a["forward_bytes"] == b["forward_bytes"], (a["forward_bytes"], b["forward_bytes"])
        assert a["backward_calls"] == b["backward_calls"]
        # FSDP2 keeps the root's parameters gathered after the root's forward (its heuristic for
        # the root); the same holds with the loss inside that forward, and both reshard in backward.
        assert a["head_sharded_after_forward"] == b["head_sharded_after_forward"]
        assert a["head_sharded_after_step"] and b["head_sharded_after_step"]


def test_fsdp2_model_with_the_patched_forward(pool):
    """``enable_linear_cross_entropy`` on the sharded model: ``model(**batch, labels=...)`` runs the
    hidden-state loss inside FSDP2's own root call."""
    results = pool.run(fsdp_tasks.causal_lm_loss_step, (2,), "llama", True, False, "patched")
    assert not any(r["logits_built"] for r in results)
    _check_against_reference(results)


def test_fsdp2_head_sharded_on_its_own(pool):
    """``fully_shard(model.lm_head)`` too: the loss runs inside the head's call as well."""
    results = pool.run(fsdp_tasks.causal_lm_loss_step, (2,), "llama", False, True, True)
    _check_against_reference(results)
