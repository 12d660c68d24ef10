"""``enable_packing`` under Accelerate's ``ParallelismConfig(cp_size=N)``: ``Trainer`` and TRL's
``SFTTrainer`` (FSDP2 over 4 gloo processes, one process group for the module) train packed batches
with every document kept apart and equal one process on the same batches: the logged losses, the
evaluation loss and every parameter's change after 3 SGD steps. The model trains in float64, so
that its changes must agree to 1e-9 relative (in float32 the smallest gradients, the attention
projections', carry round-off of 1e-5 relative; TRL's fused head computes in float32, 1e-6);
Trainer logs losses through a float32 sum (1e-6).

Stock, this path runs torch's ring attention with ``is_causal=True`` (packed documents attend to
each other on a GPU; on CPU torch has no sharding rule for its sdpa kernel)."""

from __future__ import annotations

import types

import pytest
import torch

from bench.harness.dist_pool import dist_pool_fixture
from tests.model_patches.context_parallel import trainer_workers as workers

pool = dist_pool_fixture(4)


@pytest.fixture(scope="module")
def one_process():
    """The references: one process, the whole global batch per step (as one, and as 2 accumulated),
    each in a fresh process (a run sets Accelerate's state and functional_ce's maths for its process)."""
    from bench.harness import isolated

    runs = {(trainer, accumulation): isolated.call(workers.reference, trainer, accumulation, timeout=600)
            for trainer, accumulation in (("trainer", 1), ("trainer", 2), ("sft", 1))}
    for run in runs.values():
        run["updates"] = {name: torch.from_numpy(a) for name, a in run["updates"].items()}
    return runs


def _same_run(run: dict, reference: dict, what: str, tolerance: float) -> None:
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(reference["losses"]), rtol=1e-6, atol=0)
    assert run["eval_loss"] == pytest.approx(reference["eval_loss"], rel=1e-6)
    for name, update in reference["updates"].items():
        error = float((run["updates"][name] - update).norm() / update.norm())
        assert error <= tolerance, f"{what}: the change of {name} is off by {error:.2e} relative"


@pytest.mark.parametrize("trainer, world, cp, accumulation, tolerance", [
    ("trainer", 4, 4, 1, 1e-9),  # CP=4
    ("trainer", 4, 2, 2, 1e-9),  # FSDP2 x CP as 2 x 2, 2 accumulated micro-batches
    ("sft", 4, 4, 1, 1e-6),      # TRL, padding-free rows; its fused head computes in float32
])
def test_trainer_under_context_parallelism_equals_one_process(pool, one_process, trainer, world, cp, accumulation,
                                                              tolerance):
    runs = pool.run(workers.train, (world,), trainer, world, cp, accumulation)
    for rank, run in enumerate(runs):
        _same_run(run, one_process[(trainer, accumulation)], f"{trainer} rank {rank} (cp={cp})", tolerance)


def test_label_smoothing_is_refused_with_the_setting(pool):
    messages = pool.run(workers.refusal, (4,), {"label_smoothing_factor": 0.1})
    assert all("label_smoothing_factor=0" in m for m in messages), messages


def test_releases_that_count_labels_per_process_are_refused_with_the_upgrade():
    from model_patches.context_parallel import trainer
    from model_patches.registry import apply_records

    handle = apply_records(trainer.CONTEXT_PARALLEL_TRAINER_RECORDS, version="5.18.0")
    try:
        from transformers import Trainer

        fake = types.SimpleNamespace(accelerator=types.SimpleNamespace(
            parallelism_config=types.SimpleNamespace(cp_enabled=True, cp_size=2)))
        with pytest.raises(ValueError, match=r"transformers>=5\.19"):
            Trainer._prepare_context_parallel_inputs(fake, torch.nn.Linear(1, 1), {})
    finally:
        handle.remove()


def test_a_per_token_input_that_would_stay_whole_is_refused():
    from model_patches.context_parallel.trainer import trainer_inputs

    ids = torch.arange(8).view(1, 8)
    with pytest.raises(ValueError, match="token_type_ids"):
        trainer_inputs({"input_ids": ids, "token_type_ids": torch.zeros_like(ids)}, 2, 0)
    local = trainer_inputs({"input_ids": ids, "labels": ids, "cu_seq_lens_q": torch.tensor([0, 8]), "use_cache": False},
                           2, 1)
    assert "cu_seq_lens_q" not in local and local["use_cache"] is False and "num_items_in_batch" not in local
    assert local["input_ids"].tolist() == [[2, 3, 4, 5]]  # pieces 1 and 2 of 4: the middle of the row


def test_a_shard_of_packed_rows_is_recognised_from_its_positions():
    """Sequence-parallel process ``r`` holds the ``r``-th contiguous piece of each row: unpacked, its
    positions are the row's own; packed, they restart (or start elsewhere) or the mask holds ids."""
    from model_patches.context_parallel.trainer import _packed

    assert not _packed({"position_ids": torch.arange(4, 8)[None]}, 1)
    assert _packed({"position_ids": torch.tensor([[4, 5, 0, 1]])}, 1)
    assert _packed({"position_ids": torch.tensor([[2, 3, 4, 5]])}, 1)  # a document began inside piece 0
    assert _packed({"attention_mask": torch.tensor([[1, 1, 2, 2]])}, 0)
    assert not _packed({"attention_mask": torch.tensor([[1, 1, 1, 0]])}, 0)


def test_ulysses_refuses_packed_rows_unless_flash_attention_keeps_them_apart(pool):
    """DeepSpeed's Ulysses drops the mask after its all-to-all: packed rows with sdpa are refused on
    every process of the group (the first piece of the row looks unpacked on its own), with the
    settings to change; unpacked rows and flash attention pass."""
    pytest.importorskip("deepspeed")
    for message in pool.run(workers.ulysses_refusal, (4,), True, "sdpa"):
        assert "attn_implementation='flash_attention_2'" in message and "cp_size" in message
    assert pool.run(workers.ulysses_refusal, (4,), False, "sdpa") == [None] * 4
    assert pool.run(workers.ulysses_refusal, (4,), True, "flash_attention_2") == [None] * 4
