"""A policy inside the trainers people run: ``transformers.Trainer`` turns Hugging Face's
checkpointing on in ``train()`` from its training arguments, so the refusal of double
checkpointing names the training argument that works, and following it trains with the losses
of training without any checkpointing (the policy changes no gradient). TRL's ``SFTTrainer``
(whose configs default ``gradient_checkpointing`` to True) runs the same checks when installed."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

import ac_policies
from ac_policies.apply import trainer_checkpointing_argument
from tests.support.tiny_models import tiny_ac_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")
STEPS = 3


def _dataset(n: int = 12) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(n):
        ids = torch.randint(2, 128, (16,), generator=g)
        rows.append({"input_ids": ids, "labels": ids.clone()})
    return rows


def _losses(trainer) -> list[float]:
    trainer.train()
    return [row["loss"] for row in trainer.state.log_history if "loss" in row]


def _trainer(model: torch.nn.Module, tmp_path, **arguments):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir=str(tmp_path), max_steps=STEPS, per_device_train_batch_size=4, logging_steps=1,
        report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
        seed=0, **arguments,
    )
    return Trainer(model=model, args=args, train_dataset=_dataset())


def test_trainer_refusal_names_the_training_argument_and_following_it_trains(tmp_path) -> None:
    argument = trainer_checkpointing_argument()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # gradient_checkpointing is an alias on Transformers 5.25
        model = tiny_ac_model("llama")
        with ac_policies.apply_policy(model, "full"):
            trainer = _trainer(model, tmp_path / "on", **{argument: True})
            with pytest.raises(ValueError, match=f"checkpointing twice.*{argument}=False"):
                trainer.train()
        plain = _losses(_trainer(tiny_ac_model("llama"), tmp_path / "plain"))
        model = tiny_ac_model("llama")
        with ac_policies.apply_policy(model, "full"):
            advised = _losses(_trainer(model, tmp_path / "off", **{argument: False}))
    assert len(plain) == STEPS and advised == plain


def test_sft_trainer_defaults_are_refused_and_the_named_argument_trains(tmp_path) -> None:
    pytest.importorskip("trl")
    from bench.harness.trainers import sft_trainer

    rows = [row["input_ids"].tolist() for row in _dataset()]
    argument = trainer_checkpointing_argument()

    def sft(model, out, **extra):
        return sft_trainer(model, tmp_path / out, rows, steps=STEPS, **extra)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model = tiny_ac_model("llama")
        with ac_policies.apply_policy(model, "full"):
            with pytest.raises(ValueError, match=f"{argument}=False"):
                sft(model, "defaults").train()  # TRL's default turns Hugging Face checkpointing on
        off = {argument: False, "gradient_checkpointing": False}
        plain = _losses(sft(tiny_ac_model("llama"), "plain", **off))
        model = tiny_ac_model("llama")
        with ac_policies.apply_policy(model, "full"):
            advised = _losses(sft(model, "advised", **off))
    assert len(plain) == STEPS and advised == plain


@pytest.mark.parametrize("policy_first", [True, False], ids=["policy-then-packing", "packing-then-policy"])
def test_trainer_with_packing_and_tiled_mlps_trains_as_plain_packing(tmp_path, policy_first) -> None:
    """Checkpointed blocks with tiled MLPs on packed rows through ``Trainer``: the
    losses of the same packed run without the policy, with the patches in either order."""
    from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments

    import model_patches

    def run(model, out):
        args = TrainingArguments(
            output_dir=str(tmp_path / out), max_steps=STEPS, per_device_train_batch_size=4, logging_steps=1,
            report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
            seed=0, remove_unused_columns=False,
        )
        rows = [{"input_ids": r["input_ids"][: 6 + i % 7].tolist()} for i, r in enumerate(_dataset())]
        trainer = Trainer(model=model, args=args, train_dataset=rows, data_collator=DataCollatorWithFlattening())
        return _losses(trainer)

    model = tiny_ac_model("llama", attn_implementation="sdpa")
    with model_patches.enable_packing(model):
        plain = run(model, "plain")
    model = tiny_ac_model("llama", attn_implementation="sdpa")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ac_policies.ACPolicyWarning)
        if policy_first:
            with ac_policies.apply_policy(model, [{"when": "decoder_block", "action": "checkpoint"},
                                                  {"when": "dense_mlp", "action": "tile", "tiles": 3}]):
                with model_patches.enable_packing(model):
                    tiled = run(model, "tiled")
        else:
            with model_patches.enable_packing(model):
                with ac_policies.apply_policy(model, [{"when": "decoder_block", "action": "checkpoint"},
                                                      {"when": "dense_mlp", "action": "tile", "tiles": 3}]):
                    tiled = run(model, "tiled")
    assert len(plain) == STEPS
    torch.testing.assert_close(tiled, plain, rtol=1e-6, atol=1e-6)
