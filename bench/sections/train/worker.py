"""One ``train`` variant: a Hugging Face ``Trainer`` (or TRL ``SFTTrainer``) run in this process,
measured per step.

:func:`bench.sections.train.variant_table.run_variant` runs :func:`run` in a fresh process
(:mod:`bench.harness.isolated`); ``python -m bench.sections.train.worker '<json spec>'`` runs one by hand and
prints the result as JSON. The spec (see :func:`run`):

- ``model``, ``layers``, ``overrides`` (config values, e.g. tiny widths), ``seed``, ``device``,
  ``dtype`` (``"fp32"``; ``"bf16"`` runs ``Trainer(bf16=True)``: autocast over fp32 weights);
- ``variant``: ``hf_gc`` (``TrainingArguments(gradient_checkpointing=True)``), ``hidden_loss``
  (:func:`model_patches.enable_linear_cross_entropy`), ``policy`` (a preset name for
  :func:`ac_policies.apply_policy`), ``fit`` (a budget for :func:`ac_policies.fit` as a fraction
  of the peak without checkpointing, measured on the first batch; the policy it returns is
  applied), ``packing`` (:func:`model_patches.enable_packing` and ``PackingCollator`` instead of
  padding), ``trainer`` (``"hf"``: ``transformers.Trainer``; ``"sft"``: ``trl.SFTTrainer``, built
  by :mod:`bench.sections.train.sft`), and ``wrong`` (for the tests: ``"lr"`` trains at 10x the learning
  rate, ``"drop_token"`` stops scoring one token per step);
- ``data``: ``steps``, and either ``docs_per_step`` + ``row_len`` (documents drawn from
  :data:`bench.sections.train.data.DISTRIBUTION`) or ``context`` (one document of that many tokens per
  step, one row; ``warmup``: the first step's document has that many tokens instead);
- ``lr``.

The run: the model is built with a fixed seed (same initial weights in every variant), the
variant applied, ``Trainer`` with its default optimizer (``adamw_torch_fused``: torch's fused
AdamW, which has a CPU kernel in torch >= 2.4), constant learning rate, weight decay 0, gradient
clipping at 1.0 (``Trainer``'s default), no evaluation, no saving, batches in dataset order.
The first step is a warm-up (optimizer state, first-call compilation); memory and time come
from the later steps, each measured above its own start (:mod:`bench.sections.train.meter`; on CUDA,
``max_memory_allocated`` / ``max_memory_reserved`` after a synchronisation at every phase edge).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
import warnings
from typing import Any

import torch

from bench.sections.train.data import (
    context_documents,
    packed_batch,
    padded_batch,
    real_tokens,
    scored_tokens,
    step_documents,
)
from bench.sections.train.meter import PhaseMeter, summarize
from bench.sections.train.models import build_model
from bench.sections.train.variant import Variant


def _batches(data: dict[str, Any], vocab: int, seed: int, packing: bool) -> list[dict[str, torch.Tensor]]:
    if "context" in data:
        groups = context_documents(data["steps"], int(data["context"]), vocab, seed, warmup=data.get("warmup"))
        return [padded_batch(g) for g in groups]  # one full row: nothing to pack
    groups = step_documents(data["steps"], data["docs_per_step"], data["row_len"], vocab, seed)
    return [packed_batch(g, data["row_len"]) if packing else padded_batch(g) for g in groups]


def _drop_one_token(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    labels = batch["labels"].clone()
    row, col = (labels[:, 1:] != -100).nonzero()[-1].tolist()
    labels[row, col + 1] = -100
    return {**batch, "labels": labels}


def _apply_variant(model: torch.nn.Module, variant: Variant, first: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Patch ``model`` as ``variant`` asks; returns the handles (kept alive for the run) and notes."""
    import ac_policies
    import model_patches

    out: dict[str, Any] = {"handles": [], "policy_rows": None}
    if variant.hidden_loss and variant.trainer == "sft":
        # TRL's fused head computes SFTTrainer's loss; the hidden-state loss refuses it unless it is routed
        out["handles"].append(model_patches.enable_trl_heads())
    if variant.packing:
        out["handles"].append(model_patches.enable_packing(model=model))
    if variant.fit is not None:
        inputs = {k: v for k, v in first.items()}
        policy = ac_policies.fit(model, lambda: model(**inputs).loss, variant.fit)
        model.zero_grad(set_to_none=True)
        out["handles"].append(ac_policies.apply_policy(model, policy))
        out["policy_rows"] = len(policy.rules)
    elif variant.policy:
        out["handles"].append(ac_policies.apply_policy(model, variant.policy))
    if variant.hidden_loss:
        out["handles"].append(model_patches.enable_linear_cross_entropy(model))
    return out


def _static_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    params = [p for p in model.parameters() if p.requires_grad]
    p_bytes = sum(p.numel() * p.element_size() for p in params)
    state = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
                if isinstance(t, torch.Tensor))
    return {"params": p_bytes, "grads": p_bytes, "optimizer": state}


def _trainer_classes(meter: PhaseMeter, base: type) -> tuple[type, type]:
    """A subclass of ``base`` (``Trainer`` or ``trl.SFTTrainer``) measured by ``meter``, and its callback."""
    from torch.utils.data import SequentialSampler
    from transformers import TrainerCallback

    class MeteredTrainer(base):
        """``Trainer`` with the forward phase measured around ``compute_loss`` and the batches in order."""

        last_loss = float("nan")
        last_batch: dict[str, Any] = {}

        def _get_train_sampler(self, *args: Any, **kwargs: Any) -> SequentialSampler:
            return SequentialSampler(self.train_dataset)

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            meter.start("forward")
            out = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                       num_items_in_batch=num_items_in_batch)
            meter.stop("forward")
            meter.start("backward")
            return out

        def training_step(self, model, inputs, num_items_in_batch=None):
            self.last_batch = inputs
            loss = super().training_step(model, inputs, num_items_in_batch)
            self.last_loss = float(loss)
            return loss

    class Phases(TrainerCallback):
        """Phase boundaries around the optimizer step; the static bytes once the state exists."""

        trainer: Any = None

        def on_train_end(self, args, state, control, model=None, optimizer=None, **kwargs):
            self.static = _static_bytes(model, getattr(optimizer, "optimizer", optimizer))

        def on_step_begin(self, args, state, control, **kwargs):
            meter.step_begin()

        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            meter.stop("backward")
            self.grad_bytes = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters()
                                  if p.grad is not None)
            meter.start("optimizer")

        def on_optimizer_step(self, args, state, control, **kwargs):
            meter.stop("optimizer")

        def on_step_end(self, args, state, control, **kwargs):
            batch = self.trainer.last_batch
            meter.step_end(self.trainer.last_loss, real_tokens(batch), scored_tokens(batch), self.grad_bytes,
                           slots=int(batch["input_ids"].numel()))

    return MeteredTrainer, Phases


class _Groups(torch.utils.data.Dataset):
    """One prebuilt batch per item (the collator unwraps it): every variant sees the same steps."""

    def __init__(self, batches: list[dict[str, torch.Tensor]]) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.batches[i]


def run(spec: dict[str, Any]) -> dict[str, Any]:
    """Train ``spec``'s variant for ``spec['data']['steps']`` steps; the measured figures."""
    from transformers import Trainer, TrainingArguments

    logging.getLogger("transformers").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    device = spec.get("device", "cpu")
    seed = spec.get("seed", 0)
    variant = Variant(**spec.get("variant", {}))
    model = build_model(spec["model"], spec["layers"], spec.get("overrides"), seed=seed)
    vocab = model.config.vocab_size
    data = spec["data"]
    batches = _batches(data, vocab, seed, packing=False)  # packed below, after enable_packing
    applied = _apply_variant(model, variant, batches[0])
    if variant.packing:
        batches = _batches(data, vocab, seed, packing=True)
    if variant.wrong == "drop_token":
        batches = [_drop_one_token(b) for b in batches]
    meter = PhaseMeter(device)
    lr = float(spec.get("lr", 1e-4)) * (10.0 if variant.wrong == "lr" else 1.0)
    with tempfile.TemporaryDirectory() as out_dir:
        if variant.trainer == "sft":
            import trl

            from bench.sections.train.sft import sft_trainer

            if "context" in data:
                raise ValueError("the context probes run under transformers.Trainer only")
            MeteredTrainer, Phases = _trainer_classes(meter, trl.SFTTrainer)
            phases = Phases()
            groups = step_documents(data["steps"], data["docs_per_step"], data["row_len"], vocab, seed)
            trainer = sft_trainer(MeteredTrainer, model, variant, groups, row_len=data["row_len"], lr=lr, seed=seed,
                                  device=device, dtype=spec.get("dtype", "fp32"), out_dir=out_dir, callbacks=[phases])
        else:
            MeteredTrainer, Phases = _trainer_classes(meter, Trainer)
            phases = Phases()
            args = TrainingArguments(
                output_dir=out_dir, per_device_train_batch_size=1, max_steps=len(batches), learning_rate=lr,
                lr_scheduler_type="constant", weight_decay=0.0, seed=seed, report_to=[],
                save_strategy="no", eval_strategy="no", logging_strategy="no", disable_tqdm=True,
                remove_unused_columns=False, dataloader_num_workers=0, use_cpu=not device.startswith("cuda"),
                gradient_checkpointing=variant.hf_gc, bf16=spec.get("dtype") == "bf16",
            )
            trainer = MeteredTrainer(model=model, args=args, train_dataset=_Groups(batches),
                                     data_collator=lambda items: items[0], callbacks=[phases])
        phases.trainer = trainer
        trainer.train()
    summary = summarize(meter.steps, phases.static)
    optim = trainer.args.optim
    return {"static": phases.static, "optimizer": optim.value if hasattr(optim, "value") else str(optim),
            "policy_rows": applied["policy_rows"], "device_name": _device_name(device), **summary}


def _device_name(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return "cpu"


if __name__ == "__main__":
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        print("warning: without MALLOC_MMAP_THRESHOLD_=65536 (bench.harness.rss) freed memory stays in the resident set",
              file=sys.stderr)
    print(json.dumps(run(json.loads(sys.argv[1]))), flush=True)
