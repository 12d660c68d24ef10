"""What each process of the context-parallel Trainer tests runs: the tiny Llama trained with
``enable_packing`` through ``transformers.Trainer`` (``PackingCollator`` rows) or TRL's
``SFTTrainer`` (padding-free rows), under Accelerate's ``ParallelismConfig(cp_size, dp_shard_size)``
with FSDP2, or on one process (the reference, in the test's own process).

Both see the same global batches: ``BATCH`` rows per optimizer step, split over the data-parallel
replicas only (every process of a context-parallel group gets its replica's rows) and over the
accumulated micro-batches."""

from __future__ import annotations

import contextlib
import tempfile
from typing import Any, Optional

import torch

from tests.model_patches.workers.engines import BATCH, _rows

STEPS = 3


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter as a full tensor in its own dtype (FSDP2's shards gathered)."""
    from torch.distributed.tensor import DTensor

    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for name, p in model.named_parameters()}


def train(mesh: Optional[Any], trainer: str, world: int = 1, cp: int = 1, accumulation: int = 1,
          overrides: Optional[dict[str, Any]] = None) -> Optional[dict[str, Any]]:
    """``STEPS`` SGD steps and one evaluation with ``trainer`` (``"trainer"`` or ``"sft"``) on
    ``world`` processes, ``cp`` of them per context-parallel group (``overrides``: more training
    arguments). Returns the logged losses, the
    evaluation loss, and each parameter's change (full tensors)."""
    from bench.harness import engines

    if not engines.enter_run(world, mesh is not None):
        return None
    import model_patches
    from tests.support.tiny_models import tiny_loss_model

    # float64: the comparison then sees the algorithm, not fp32 round-off in the smallest gradients
    model = tiny_loss_model("llama").double()
    initial = _params(model)
    per_device = BATCH * cp // world // accumulation
    settings: dict[str, Any] = dict(
        max_steps=STEPS, per_device_train_batch_size=per_device, per_device_eval_batch_size=per_device,
        gradient_accumulation_steps=accumulation, logging_steps=1, report_to="none", use_cpu=True, bf16=False,
        save_strategy="no", disable_tqdm=True, seed=0, optim="sgd", learning_rate=0.1,
        train_sampling_strategy="sequential", dataloader_num_workers=0)
    settings.update(overrides or {})
    if world > 1:
        from accelerate.parallelism_config import ParallelismConfig

        settings.update(fsdp=True, fsdp_config={"version": 2},
                        parallelism_config=ParallelismConfig(cp_size=cp, dp_shard_size=world // cp))
    rows = _rows(True)
    with contextlib.ExitStack() as stack, tempfile.TemporaryDirectory() as out:
        stack.callback(model_patches.enable_packing().remove)
        if world > 1:
            stack.enter_context(engines.accelerate_fsdp_on_cpu())
        if trainer == "trainer":
            from transformers import Trainer, TrainingArguments

            run = Trainer(model=model, args=TrainingArguments(output_dir=out, **settings), train_dataset=rows[:16],
                          eval_dataset=rows[16:], data_collator=model_patches.PackingCollator(24))
        else:
            import trl
            from datasets import Dataset

            from bench.harness.trainers import word_tokenizer

            def data(part: list) -> Dataset:
                return Dataset.from_dict({"input_ids": [r["input_ids"] for r in part]})

            config = trl.SFTConfig(output_dir=out, max_length=None, padding_free=True, gradient_checkpointing=False,
                                   **settings)
            run = trl.SFTTrainer(model=model, args=config, train_dataset=data(rows[:16]), eval_dataset=data(rows[16:]),
                                 processing_class=word_tokenizer())
        run.train()
        evaluation = run.evaluate()["eval_loss"]
        final = _params(run.model)
    return {"losses": [row["loss"] for row in run.state.log_history if "loss" in row], "eval_loss": evaluation,
            "updates": {name: final[name] - initial[name] for name in initial}}


def refusal(mesh: Optional[Any], overrides: dict[str, Any]) -> Optional[str]:
    """The message of the ValueError a Trainer run raises with ``overrides``, the whole mesh one
    context-parallel group (None if it raises none)."""
    if mesh is None:
        return None
    try:
        train(mesh, "trainer", mesh.size(), mesh.size(), 1, overrides)
    except ValueError as exc:
        return str(exc)
    return None


def ulysses_refusal(mesh: Optional[Any], packed: bool, implementation: str) -> Optional[str]:
    """The refusal a Trainer step would raise under DeepSpeed's Ulysses (sp_size=2 over pairs of
    processes) on this process's shard of a row, packed or not; None when it would not."""
    import types

    import torch.distributed as dist
    from deepspeed.runtime.sequence_parallel import parallel_state_sp as mpu

    from model_patches.context_parallel import trainer

    if mesh is None:
        return None
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")  # DeepSpeed's communication layer over this group
    if mpu._SEQUENCE_PARALLEL_GROUP is None:
        mpu.initialize_sequence_parallel(sequence_parallel_size=2)
    rank = dist.get_rank(mpu.get_sequence_parallel_group())
    row = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7] if not packed else [0, 1, 2, 3, 4, 5, 0, 1])  # rank 0's piece is 0..3
    inputs = {"input_ids": torch.zeros(1, 4, dtype=torch.long), "position_ids": row[rank * 4:(rank + 1) * 4][None]}
    model = types.SimpleNamespace(config=types.SimpleNamespace(_attn_implementation=implementation))
    config = types.SimpleNamespace(sp_enabled=True, sp_backend="deepspeed", sp_size=2)
    fake = types.SimpleNamespace(accelerator=types.SimpleNamespace(parallelism_config=config, unwrap_model=lambda m: m))
    return trainer._ulysses_refusal(fake, model, inputs)


def reference(trainer: str, accumulation: int) -> dict[str, Any]:
    """:func:`train` on one process, for a fresh process of its own: the tensors as numpy arrays
    (pickled by value: the process may exit before the parent reads them)."""
    run = train(None, trainer, 1, 1, accumulation)
    return {**run, "updates": {name: t.numpy() for name, t in run["updates"].items()}}
