"""The loss patches under DeepSpeed ZeRO-2 and ZeRO-3 through ``transformers.Trainer``, on 2 gloo
processes sharing one process group for the module, DeepSpeed on its CPU accelerator.

Accelerate counts the processes of a DeepSpeed run on CPU as one; the test overrides that one
decision (:func:`tests.support.engines.accelerate_deepspeed_on_cpu`). ZeRO-3 partitions every
parameter (no persistence threshold), the LM head included. Each run must log the losses of the
same training on one process without DeepSpeed and end with the same parameters.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("accelerate")
pytest.importorskip("deepspeed")

from tests.model_patches import engine_tasks  # noqa: E402
from tests.support.dist_pool import dist_pool_fixture  # noqa: E402

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


def test_trl_heads_refuse_a_zero3_head(pool):
    pytest.importorskip("trl")
    with pytest.raises(AssertionError, match="does not support DeepSpeed ZeRO-3 heads"):
        pool.run(engine_tasks.train, (2,), "sft", ("trl_heads",), 2, None, False, 1, 3)
