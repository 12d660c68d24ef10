"""``functional_ce.cross_entropy`` as the last stage's ``loss_fn`` of ``torch.distributed.pipelining``
schedules, 2 gloo processes sharing one process group for the module: the summed loss and every
gradient equal the unpipelined model's, with and without ``inplace_grad``."""

from __future__ import annotations

import pytest
import torch

from bench.harness.dist_pool import dist_pool_fixture
from tests.functional_ce.distributed.workers import pipeline as tasks

pool = dist_pool_fixture(2)


@pytest.fixture(scope="module")
def reference():
    return tasks.reference()


@pytest.mark.parametrize("inplace", [False, True], ids=["out-of-place", "inplace"])
@pytest.mark.parametrize("schedule", list(tasks.LAYOUTS))
def test_schedule_matches_the_unpipelined_model(pool, reference, schedule, inplace):
    """reduction="sum" over the global label count (num_label_tokens), scale_grads=False."""
    results = pool.run(tasks.pipeline_step, (2,), schedule, inplace, False)
    losses = [loss for r in results if r["losses"] is not None for loss in r["losses"]]
    assert len(losses) == tasks.MICROBATCHES
    torch.testing.assert_close(sum(losses), reference["loss"], rtol=1e-6, atol=1e-6)
    seen = set()
    for r in results:
        assert r["output"] is None
        for block, grads in r["grads"].items():
            seen.add(block)
            for got, want in zip(grads, reference["grads"][block]):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    assert seen == {0, 1, 2, 3}


def test_returned_outputs_are_overwritten_by_the_inplace_gradient(pool):
    """What happens with return_outputs=True (the schedules' default) and inplace_grad=True: the
    loss cannot see that the schedule keeps the outputs, backward overwrites them with their
    gradient, and the schedule returns gradients. Hence return_outputs=False with
    inplace_grad=True (README); without inplace_grad the outputs are the logits."""
    kept = pool.run(tasks.pipeline_step, (2,), "1F1B", False, True)[1]["output"]
    overwritten = pool.run(tasks.pipeline_step, (2,), "1F1B", True, True)[1]["output"]
    ids, labels = tasks.batch()
    model = torch.nn.Sequential(*tasks.blocks())
    logits = model(ids).detach().requires_grad_()
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, tasks.V), labels.reshape(-1), reduction="sum")
    (loss / int((labels != -100).sum())).backward()
    torch.testing.assert_close(kept, logits.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(overwritten, logits.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("scale_grads", [True, False], ids=["mean-scale_grads", "sum-over-global-count"])
def test_last_stage_emitting_hidden_states_with_the_loss_owning_the_head(pool, reference, scale_grads):
    """pipeline_loss_fn on a last stage that holds the LM head: the schedule scales the head's
    gradient with the stage's other parameters."""
    results = pool.run(tasks.hidden_state_loss_step, (2,), scale_grads)
    expected = tasks.microbatch_mean_reference() if scale_grads else reference
    losses = results[1]["losses"]
    total = sum(losses) / len(losses) if scale_grads else sum(losses)
    torch.testing.assert_close(total, expected["loss"], rtol=1e-6, atol=1e-6)
    for r in results:
        for block, grads in r["grads"].items():
            for got, want in zip(grads, expected["grads"][block]):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
