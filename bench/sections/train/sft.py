"""The ``train`` section's ``trl.SFTTrainer`` runs: the same documents, steps and weights as the
``Trainer`` runs, through TRL's trainer.

:func:`sft_trainer` builds one. ``SFTTrainer`` computes its loss with TRL's fused LM head
(``model(**inputs, fused_lm_head=True)``: the backbone, then TRL's chunked log-prob kernel), so:

- stock (``sft``, ``sft+hf_gc``): TRL's head and TRL's own collator
  (``DataCollatorForLanguageModeling``: each step's documents one per row, padded to the longest);
  ``gradient_checkpointing`` as the variant says (TRL defaults it to on);
- ``hidden_loss``: ``model_patches.enable_trl_heads()`` (TRL's head runs on
  ``functional_ce.linear_token_logprobs``) plus ``enable_linear_cross_entropy(model)``, which refuses
  TRL's unrouted head (README, "With TRL"), applied by :mod:`bench.sections.train.worker`;
- ``packing``: ``enable_packing(model=model)`` and the library's ``PackingCollator(row_len)`` as the
  trainer's ``data_collator``, over the same documents.

The dataset is pre-tokenized (an ``input_ids`` column, one document per example, in step order;
TRL builds ``labels`` as a copy of the ids and truncates nothing, since every document fits
``max_length``) and read in order, ``docs_per_step`` examples per optimizer step. TRL's loss is the
per-token mean over the labels after the causal shift, the same tokens the ``Trainer`` rows score.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any

from bench.sections.train.variant import Variant

VARIANTS: dict[str, Variant] = {
    "sft": Variant(trainer="sft"),
    "sft+hf_gc": Variant(trainer="sft", hf_gc=True),
    "sft:hidden_loss": Variant(trainer="sft", hidden_loss=True),
    "sft:packing": Variant(trainer="sft", packing=True),
    "sft:all": Variant(trainer="sft", packing=True, hidden_loss=True, policy="full"),
}
DESCRIPTIONS = {
    "sft": "trl.SFTTrainer as it comes (TRL's fused LM head, TRL's padding collator), gradient_checkpointing=False",
    "sft+hf_gc": "trl.SFTTrainer with its default gradient_checkpointing=True",
    "sft:hidden_loss": "SFTTrainer with model_patches.enable_trl_heads() + enable_linear_cross_entropy(model)",
    "sft:packing": "SFTTrainer with enable_packing(model=model) + data_collator=PackingCollator(row_len)",
    "sft:all": "SFTTrainer with enable_trl_heads + enable_linear_cross_entropy + PackingCollator + apply_policy('full')",
}


def trl_available() -> bool:
    """Whether TRL (and ``datasets``, which ``SFTTrainer`` needs) can be imported."""
    return all(importlib.util.find_spec(m) is not None for m in ("trl", "datasets"))


def sft_trainer(trainer_cls: type, model: Any, variant: Variant, groups: list[list[list[int]]], *,
                row_len: int, lr: float, seed: int, device: str, dtype: str, out_dir: str, callbacks: list) -> Any:
    """A ``trainer_cls`` (a subclass of ``trl.SFTTrainer``) over ``groups`` (per step, its documents).

    Raises:
        ValueError: ``variant`` is not an SFT variant, or the steps hold different numbers of documents.
    """
    import trl
    from datasets import Dataset

    from bench.harness.trainers import word_tokenizer
    from model_patches import PackingCollator

    if variant.trainer != "sft":
        raise ValueError(f"not an SFTTrainer variant: {variant}")
    if variant.wrong is not None:
        raise ValueError("the deliberately wrong variants run under transformers.Trainer only")
    per_step = {len(g) for g in groups}
    if len(per_step) != 1:
        raise ValueError(f"every step needs the same number of documents for SFTTrainer, got {sorted(per_step)}")
    fields = {f.name for f in dataclasses.fields(trl.SFTConfig)}
    checkpointing = {k: variant.hf_gc for k in ("gradient_checkpointing", "activation_checkpointing") if k in fields}
    config = trl.SFTConfig(
        output_dir=out_dir, per_device_train_batch_size=per_step.pop(), max_steps=len(groups), learning_rate=lr,
        lr_scheduler_type="constant", weight_decay=0.0, seed=seed, report_to=[], save_strategy="no",
        eval_strategy="no", logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
        use_cpu=not device.startswith("cuda"), bf16=dtype == "bf16", max_length=row_len, packing=False,
        padding_free=False, **checkpointing,
    )
    docs = [d for g in groups for d in g]
    collator = PackingCollator(row_len) if variant.packing else None  # None: TRL's own padding collator
    return trainer_cls(model=model, args=config, train_dataset=Dataset.from_dict({"input_ids": docs}),
                       processing_class=word_tokenizer(), data_collator=collator, callbacks=callbacks)
