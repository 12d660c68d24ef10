"""``transformers.Trainer`` on Accelerate's FSDP2 with the hidden-state loss (no logits), leak-free
sequence packing and an activation-checkpointing policy. The engine comes from the launcher:

    accelerate launch --config_file examples/accelerate_fsdp2.yaml examples/accelerate_fsdp2_trainer.py

Every patch is applied to the plain model before ``Trainer`` is built; Accelerate's ``prepare``
then shards it (``fully_shard`` on each decoder layer, the head group and the root) and the loss
runs inside the FSDP2 root's own call. Run as is (``python ... --tiny``) it trains on one process
without an engine, the same code.
"""

from __future__ import annotations

import argparse
import math
import pathlib
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import model_patches  # noqa: E402
from ac_policies import apply_policy  # noqa: E402


def main() -> None:
    from _tiny import documents, tiny_model
    from transformers import Trainer, TrainingArguments

    parser = argparse.ArgumentParser()
    parser.add_argument("--tiny", action="store_true", help="3 steps of a 2-layer model")
    args = parser.parse_args()
    steps = 3 if args.tiny else 200
    model = tiny_model("llama", seed=0)
    model_patches.enable_linear_cross_entropy(model)  # the loss from hidden states: no [tokens, vocab] logits
    model_patches.enable_packing()  # packed documents never attend to each other
    apply_policy(model, "full")  # checkpoint every decoder layer
    rows = [{"input_ids": d} for d in documents(64, seed=0)]
    with tempfile.TemporaryDirectory() as out:
        config = TrainingArguments(output_dir=out, max_steps=steps, per_device_train_batch_size=2,
                                   learning_rate=1e-3, logging_steps=1, report_to="none", save_strategy="no",
                                   disable_tqdm=True, remove_unused_columns=False)
        trainer = Trainer(model=model, args=config, train_dataset=rows,
                          data_collator=model_patches.PackingCollator(32))
        trainer.train()
    engine = trainer.accelerator.distributed_type
    print(f"engine: {engine}, model: {type(trainer.model_wrapped).__name__}")
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    assert losses and all(math.isfinite(x) for x in losses), losses
    print(f"loss {losses[-1]:.4f} after {len(losses)} steps")


if __name__ == "__main__":
    main()
