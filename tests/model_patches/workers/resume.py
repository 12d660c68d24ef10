"""Trainer runs of a tiny MoE model for the resume tests: whole, stopped after its first checkpoint,
or resumed from that checkpoint (``python -m tests.model_patches.workers.resume FAMILY PATCH OUT resume``
in a new process, as a user resumes an interrupted job).

Every run builds the model from its config (the resumed one with other random weights, so that
whatever the checkpoint does not restore shows), applies ``PATCH`` (a library patch, or ``stock``),
and trains ``STEPS`` optimizer steps on the same rows, saving a checkpoint every ``SAVE`` steps. It
returns the loss logged at each step, the final parameters, and how many tensors the resume
conversion restored.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import warnings
from typing import Any

import torch

STEPS, SAVE = 4, 2
PATCHES = ("stock", "packing", "hidden_state_loss", "policy")


def _patched(model: torch.nn.Module, patch: str) -> contextlib.ExitStack:
    import ac_policies
    import model_patches

    stack = contextlib.ExitStack()
    if patch == "packing":
        stack.enter_context(model_patches.enable_packing())
    elif patch == "hidden_state_loss":
        stack.enter_context(model_patches.enable_linear_cross_entropy(model))
    elif patch == "policy":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ac_policies.ACPolicyWarning)
            stack.enter_context(ac_policies.apply_policy(model, "non_moe"))
    return stack


def run(family: str, patch: str, out: str, mode: str) -> dict[str, Any]:
    """``mode``: ``whole`` (STEPS steps), ``first`` (stops after the checkpoint at step SAVE) or
    ``resume`` (from ``OUT/checkpoint-SAVE``)."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    import model_patches.checkpoint_resume as resume
    from ac_policies.apply import trainer_checkpointing_argument
    from tests.support.tiny_models import LOSS_VOCAB, tiny_loss_model

    restored = []
    real = resume.restore_checkpoint_layout

    def counting(model, folder):
        restored.append(real(model, folder))
        return restored[-1]

    resume.restore_checkpoint_layout = counting
    g = torch.Generator().manual_seed(0)
    rows = torch.randint(0, LOSS_VOCAB, (16, 12), generator=g)
    data = [{"input_ids": row, "labels": row} for row in rows]

    class StopAtCheckpoint(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = mode == "first" and state.global_step == SAVE

    args = TrainingArguments(
        output_dir=out, max_steps=STEPS, per_device_train_batch_size=4, save_strategy="steps", save_steps=SAVE,
        logging_steps=1, report_to="none", use_cpu=True, seed=0, disable_tqdm=True, learning_rate=1e-2,
        **{trainer_checkpointing_argument(): False},
    )
    model = tiny_loss_model(family, seed=123 if mode == "resume" else 0)
    with warnings.catch_warnings(), _patched(model, patch):
        warnings.simplefilter("ignore")
        trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[StopAtCheckpoint()])
        trainer.train(resume_from_checkpoint=os.path.join(out, f"checkpoint-{SAVE}") if mode == "resume" else None)
    return {
        "losses": [row["loss"] for row in trainer.state.log_history if "loss" in row],
        "params": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "restored": sum(restored),
    }


if __name__ == "__main__":
    family, patch, out, mode = sys.argv[1:5]
    result = run(family, patch, out, mode)
    torch.save(result["params"], os.path.join(out, f"params_{mode}.pt"))
    print(json.dumps({"losses": result["losses"], "restored": result["restored"]}))
