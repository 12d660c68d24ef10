"""Training runs through ``transformers.Trainer`` and TRL's ``SFTTrainer`` under Accelerate's
engines, for the engine tests: the same function runs on every process of a
:class:`bench.harness.dist_pool.DistPool` (sharded) and in the test's own process (the
one-process reference).

A run builds the seeded tiny Llama, applies the named patches, and trains ``steps`` optimizer
steps on the same rows in a fixed order (``train_sampling_strategy="sequential"``). On ``world``
processes each takes ``batch // world`` rows of every global batch of ``batch`` rows, which is
how Accelerate splits a sequential loader, so both runs see the same global batches. It returns
the loss logged at each step, the parameters after the last step (full tensors), how many times the
library's losses ran, and what wrapped the model.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Any, Optional

import torch

from bench.harness.trainers import token_rows

ROWS = 24
STEPS = 3
BATCH = 4  # the global batch: rows per optimizer step over all processes


def _rows(packing: bool) -> list[dict[str, list[int]]]:
    rows = token_rows(ROWS, length=16, seed=3, ragged=packing)
    return [{"input_ids": r, "labels": list(r)} for r in rows]


def _collator(packing: bool):
    if packing:
        from model_patches import PackingCollator

        return PackingCollator(24)
    from transformers import default_data_collator

    return default_data_collator


def _apply(model: torch.nn.Module, patches: tuple[str, ...], stack: contextlib.ExitStack) -> None:
    """Apply ``patches``; the process-wide ones are undone when ``stack`` closes, the model's own go
    with the model (Accelerate's mixed precision wraps the forward on top of them)."""
    import model_patches
    from ac_policies import apply_policy

    for name in patches:
        if name == "hidden_state_loss":
            model_patches.enable_linear_cross_entropy(model)
        elif name == "chunked_loss":
            stack.callback(model_patches.enable_chunked_loss(model=model).remove)
        elif name == "trl_heads":
            stack.callback(model_patches.enable_trl_heads().remove)
        elif name == "packing":
            stack.callback(model_patches.enable_packing().remove)
        elif name == "policy":
            apply_policy(model, "full")
        else:
            raise ValueError(f"unknown patch {name!r}")


def _zero_config(stage: int, bf16: bool) -> dict[str, Any]:
    """A DeepSpeed config for ``stage``; every parameter partitioned at stage 3, however small."""
    zero: dict[str, Any] = {"stage": stage}
    if stage == 3:
        zero.update(stage3_param_persistence_threshold=0, stage3_gather_16bit_weights_on_model_save=False)
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "train_batch_size": "auto", "gradient_clipping": "auto", "bf16": {"enabled": bf16},
            "zero_optimization": zero}


def _full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    if any(hasattr(p, "ds_id") for p in model.parameters()):
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(model.parameters())):
            return {name: p.detach().float().clone() for name, p in model.named_parameters()}
    return {
        name.replace("_checkpoint_wrapped_module.", ""):
            (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().clone()
        for name, p in model.named_parameters()
    }


def _outside_forward(model: torch.nn.Module) -> Optional[str]:
    """The message of the routed fused head called with ``model``'s head weight outside any forward
    (under ZeRO-3: a partitioned weight nothing gathers for the backward), or None if it computes."""
    from model_patches.loss.trl_compute import routed_logprobs

    head = model.lm_head
    try:
        routed_logprobs(torch.zeros(2, head.in_features), head.weight, head.bias, torch.zeros(2, dtype=torch.long),
                        1.0, 128)
    except ValueError as exc:
        return str(exc)
    return None


def train(mesh: Any, trainer: str, patches: tuple[str, ...], world: int = 1, fsdp: Optional[dict] = None,
          bf16: bool = False, steps: int = STEPS, zero: Optional[int] = None) -> dict[str, Any]:
    """Train the tiny Llama with ``trainer`` (``"trainer"`` or ``"sft"``) and ``patches`` on ``world``
    processes (``fsdp``: the ``fsdp_config`` of Accelerate's FSDP2; ``zero``: a DeepSpeed ZeRO
    stage; neither: no sharding)."""
    from bench.harness import engines

    if not engines.enter_run(world, mesh is not None):
        return None
    from tests.support.tiny_models import tiny_loss_model

    packing = "packing" in patches
    model = tiny_loss_model("llama")
    settings: dict[str, Any] = dict(
        max_steps=steps, per_device_train_batch_size=BATCH // world, logging_steps=1, report_to="none",
        use_cpu=True, bf16=bf16, save_strategy="no", disable_tqdm=True, seed=0, learning_rate=1e-3,
        train_sampling_strategy="sequential", dataloader_num_workers=0,
    )
    if fsdp is not None:
        settings.update(fsdp=True, fsdp_config={"version": 2, **fsdp})
    if zero is not None:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        settings.update(use_cpu=False, deepspeed=_zero_config(zero, bf16))
    from model_patches.loss import unused_loss_watch as loss_use

    calls = loss_use._REACHED[0]
    with contextlib.ExitStack() as stack, tempfile.TemporaryDirectory() as out:
        _apply(model, patches, stack)
        if fsdp is not None:
            stack.enter_context(engines.accelerate_fsdp_on_cpu())
        if zero is not None:
            stack.enter_context(engines.accelerate_deepspeed_on_cpu())
        run = _trainer(trainer, model, out, settings, packing)
        run.train()
        losses = [row["loss"] for row in run.state.log_history if "loss" in row]
        calls = loss_use._REACHED[0] - calls
        outside = _outside_forward(run.model) if "trl_heads" in patches else None
        wrapped = run.model_wrapped
        from torch.distributed.fsdp import FSDPModule

        if zero is not None:
            from transformers.integrations.deepspeed import unset_hf_deepspeed_config

            unset_hf_deepspeed_config()
        return {
            "head_partitioned": getattr(run.model.lm_head.weight, "ds_numel", 0) > run.model.lm_head.weight.numel(),
            "losses": losses, "params": _full_params(run.model), "loss_calls": calls, "outside_forward": outside,
            "fsdp": isinstance(run.model, FSDPModule), "wrapper": type(wrapped).__name__,
            "distributed_type": str(run.accelerator.distributed_type),
        }


def _trainer(kind: str, model: torch.nn.Module, out: str, settings: dict[str, Any], packing: bool):
    rows = _rows(packing)
    if kind == "trainer":
        from transformers import Trainer, TrainingArguments

        return Trainer(model=model, args=TrainingArguments(output_dir=out, **settings), train_dataset=rows,
                       data_collator=_collator(packing))
    import trl
    from datasets import Dataset

    from bench.harness.trainers import word_tokenizer

    config = trl.SFTConfig(output_dir=out, max_length=32, gradient_checkpointing=False, **settings)
    data = Dataset.from_dict({"input_ids": [r["input_ids"] for r in rows]})
    return trl.SFTTrainer(model=model, args=config, train_dataset=data, processing_class=word_tokenizer())


def refusal(mesh: Any, order: str) -> str:
    """Accelerate's FSDP activation checkpointing with ``apply_policy``: the policy first and then
    ``Trainer.train()`` (``order="policy_first"``), or Accelerate's ``prepare`` first and then the
    policy (``"accelerate_first"``). Returns the message of the ValueError raised."""
    import torch.distributed as dist

    from ac_policies import apply_policy
    from bench.harness import engines
    from tests.support.tiny_models import tiny_loss_model

    if mesh is None:
        return None
    engines.distributed_env(dist.get_rank(), dist.get_world_size())
    engines.reset_accelerate()
    model = tiny_loss_model("llama")
    with engines.accelerate_fsdp_on_cpu(), tempfile.TemporaryDirectory() as out:
        try:
            if order == "policy_first":
                apply_policy(model, "full")
                settings = dict(max_steps=1, per_device_train_batch_size=2, report_to="none", use_cpu=True,
                                save_strategy="no", disable_tqdm=True, fsdp=True,
                                fsdp_config={"version": 2, "activation_checkpointing": True})
                _trainer("trainer", model, out, settings, False).train()
            else:
                from accelerate import Accelerator
                from accelerate.utils import FullyShardedDataParallelPlugin

                plugin = FullyShardedDataParallelPlugin(fsdp_version=2, activation_checkpointing=True, auto_wrap_policy="transformer_based_wrap",
                                                        transformer_cls_names_to_wrap=["LlamaDecoderLayer"])
                model = Accelerator(cpu=True, fsdp_plugin=plugin).prepare(model)
                apply_policy(model, "full")
        except ValueError as exc:
            return str(exc)
    raise AssertionError(f"{order}: Accelerate's activation checkpointing and a policy were not refused")
