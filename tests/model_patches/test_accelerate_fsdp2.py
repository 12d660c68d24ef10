"""Every loss patch, packing and an activation-checkpointing policy under Accelerate's FSDP2,
through ``transformers.Trainer`` and TRL's ``SFTTrainer`` and ``GRPOTrainer``, on 2 gloo processes
sharing one process group for the module.

Accelerate takes its FSDP path only on an accelerator; on these CPU processes the test overrides
its distributed-type decision and nothing else (:mod:`bench.harness.engines` says what and why).
Each run must log, step by step, the losses of the same training on one process without sharding
(same global batches, same order), and end with the same parameters. The one-process reference
runs in the test's own process.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("accelerate")

from bench.harness.dist_pool import dist_pool_fixture  # noqa: E402
from tests.model_patches.workers import engines as engine_tasks  # noqa: E402

pool = dist_pool_fixture(2)

FP32 = dict(rtol=1e-5, atol=1e-5)
#: bf16 mixed precision: Accelerate's FSDP2 casts parameters to bf16 per unit
#: (``MixedPrecisionPolicy``) where one process runs the fp32 model under autocast; they round
#: differently, by about 1e-4 of the loss over 3 steps of this model.
BF16 = dict(rtol=2e-3, atol=0.0)


def _same_training(trainer: str, patches: tuple[str, ...], bf16: bool = False, pool=None) -> None:
    reference = engine_tasks.train(None, trainer, patches, 1, None, bf16)
    results = pool.run(engine_tasks.train, (2,), trainer, patches, 2, {}, bf16)
    tol = BF16 if bf16 else FP32
    assert len(reference["losses"]) == engine_tasks.STEPS
    for rank, r in enumerate(results):
        assert r["fsdp"] and r["distributed_type"].endswith("FSDP"), (rank, r["wrapper"], r["distributed_type"])
        assert r["loss_calls"] == reference["loss_calls"]  # the library's loss ran as often on each process
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(reference["losses"]), **tol)
        if bf16:
            continue
        assert set(r["params"]) == set(reference["params"])
        for name, value in r["params"].items():
            torch.testing.assert_close(value, reference["params"][name], **tol, msg=lambda m: f"{name}: {m}")


def test_trainer_every_patch_together(pool):
    _same_training("trainer", ("hidden_state_loss", "packing", "policy"), pool=pool)


def test_trainer_hidden_state_loss_on_the_fsdp2_root(pool):
    """The patched forward on the model Accelerate turns into the FSDP2 root."""
    _same_training("trainer", ("hidden_state_loss",), pool=pool)


@pytest.mark.parametrize("order", ["policy_first", "accelerate_first"])
def test_accelerate_activation_checkpointing_with_a_policy_is_refused(pool, order):
    messages = pool.run(engine_tasks.refusal, (2,), order)
    for message in messages:
        assert "checkpointing twice" in message
        assert "fsdp_activation_checkpointing" in message and "activation_checkpointing" in message


@pytest.mark.slow
@pytest.mark.parametrize("patches", [(), ("packing",), ("policy",)], ids=["stock", "packing", "policy"])
def test_trainer_each_patch(pool, patches):
    _same_training("trainer", patches, pool=pool)


@pytest.mark.slow
def test_trainer_chunked_loss(pool):
    """The logits' loss routed through functional_ce.cross_entropy, on the FSDP2 root's logits."""
    _same_training("trainer", ("chunked_loss", "packing"), pool=pool)


@pytest.mark.slow
@pytest.mark.parametrize("patches", [(), ("trl_heads",), ("hidden_state_loss", "trl_heads", "policy")],
                         ids=["stock", "trl_heads", "together"])
def test_sft_trainer(pool, patches):
    pytest.importorskip("trl")
    _same_training("sft", patches, pool=pool)


@pytest.mark.slow
def test_trainer_bf16_mixed_precision(pool):
    _same_training("trainer", ("hidden_state_loss", "packing", "policy"), bf16=True, pool=pool)


@pytest.mark.slow
@pytest.mark.parametrize("patches", [("trl_heads",), ("trl_heads", "packing")], ids=["trl_heads", "with_packing"])
def test_grpo_trainer(pool, patches):
    """TRL's GRPOTrainer with its fused head routed through functional_ce (and the packing patch on
    the rollouts' ``generate``): the same rollouts (forced: ``grpo_engine_tasks`` says why and
    how), rewards, losses and parameters as one process without sharding."""
    pytest.importorskip("trl")
    from tests.model_patches.workers import grpo_engines as grpo_engine_tasks

    reference = grpo_engine_tasks.train_grpo(None, patches, 1, None)
    results = pool.run(grpo_engine_tasks.train_grpo, (2,), patches, 2, {})
    logged = torch.tensor(reference["logged"])
    assert logged.shape == (grpo_engine_tasks.STEPS, len(grpo_engine_tasks.LOGGED))
    # Completions of every group differ in reward: non-zero advantages, losses and updates.
    assert (logged[:, 0].abs() > 1e-3).all() and (logged[:, 2] > 0).all() and (logged[:, 3] == 0).all()
    assert reference["loss_calls"] >= grpo_engine_tasks.STEPS
    assert any(not torch.equal(value, reference["initial"][name]) for name, value in reference["params"].items())
    for rank, r in enumerate(results):
        assert r["fsdp"] and r["distributed_type"].endswith("FSDP"), (rank, r["wrapper"], r["distributed_type"])
        assert r["loss_calls"] == reference["loss_calls"]  # the routed head ran as often on each process
        torch.testing.assert_close(torch.tensor(r["logged"]), logged, **FP32)
        assert set(r["params"]) == set(reference["params"])
        for name, value in r["params"].items():
            torch.testing.assert_close(value, reference["params"][name], **FP32, msg=lambda m: f"{name}: {m}")
