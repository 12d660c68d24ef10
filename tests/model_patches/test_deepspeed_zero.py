"""The loss patches under DeepSpeed ZeRO-2 and ZeRO-3 through ``transformers.Trainer``, on 2 gloo
processes sharing one process group for the module, DeepSpeed on its CPU accelerator.

Accelerate counts the processes of a DeepSpeed run on CPU as one; the test overrides that one
decision (:func:`bench.harness.engines.accelerate_deepspeed_on_cpu`). ZeRO-3 partitions every
parameter (no persistence threshold), the LM head included. Each run must log the losses of the
same training on one process without DeepSpeed and end with the same parameters; so must
SFTTrainer with TRL's fused heads routed through functional_ce under ZeRO-3.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("accelerate")
pytest.importorskip("deepspeed")

from bench.harness.dist_pool import dist_pool_fixture  # noqa: E402
from tests.model_patches.workers import engines as engine_tasks  # noqa: E402

pool = dist_pool_fixture(2)

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("patches", [(), ("hidden_state_loss",), ("hidden_state_loss", "packing", "policy")],
                         ids=["stock", "hidden_state_loss", "together"])
@pytest.mark.parametrize("zero", [2, 3])
def test_trainer_under_zero(pool, zero, patches):
    reference = engine_tasks.train(None, "trainer", patches)
    results = pool.run(engine_tasks.train, (2,), "trainer", patches, 2, None, False, engine_tasks.STEPS, zero)
    for r in results:
        assert r["wrapper"] == "DeepSpeedEngine"
        assert r["head_partitioned"] == (zero == 3)
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(reference["losses"]), rtol=1e-5, atol=1e-5)
        for name, value in r["params"].items():
            torch.testing.assert_close(value, reference["params"][name], rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"{name}: {m}")


def test_sft_trainer_trl_heads_under_zero3(pool):
    """TRL's fused head on functional_ce with the head partitioned: ZeRO-3 gathers it for the
    kernel's forward and again for its backward (as an external parameter of the model's forward)."""
    pytest.importorskip("trl")
    reference = engine_tasks.train(None, "sft", ("trl_heads",))
    assert reference["loss_calls"] == engine_tasks.STEPS
    results = pool.run(engine_tasks.train, (2,), "sft", ("trl_heads",), 2, None, False, engine_tasks.STEPS, 3)
    for r in results:
        assert r["wrapper"] == "DeepSpeedEngine" and r["head_partitioned"]
        assert r["loss_calls"] == engine_tasks.STEPS  # the routed kernel, not TRL's own
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(reference["losses"]), rtol=1e-5, atol=1e-5)
        for name, value in r["params"].items():
            torch.testing.assert_close(value, reference["params"][name], rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"{name}: {m}")
        # outside any forward nothing would gather the partitioned weight for the backward: refused
        assert "that no module forward under way holds" in r["outside_forward"]
