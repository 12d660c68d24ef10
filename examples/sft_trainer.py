"""Supervised fine-tuning with ``transformers.Trainer``: packed rows whose documents stay apart,
the causal-LM loss computed from hidden states (no logits), and every decoder block checkpointed.

    python examples/sft_trainer.py --tiny        # a 2-layer random Llama, a few CPU steps

Without ``--tiny`` it trains the same way at a larger width (still random weights: swap in
``AutoModelForCausalLM.from_pretrained`` and your own documents for a real run).
"""

from __future__ import annotations

import argparse
import math
import pathlib
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import torch  # noqa: E402
import transformers  # noqa: E402
from _tiny import documents, tiny_model  # noqa: E402

import ac_policies  # noqa: E402
import model_patches  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="hidden size 32, 2 layers, 3 steps")
    parser.add_argument("--steps", type=int, default=None)
    args = parser.parse_args()
    steps = args.steps or (3 if args.tiny else 50)
    width = {} if args.tiny else dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4)

    model = tiny_model("llama", **width)
    docs = [{"input_ids": d} for d in documents(64, low=4, high=24)]
    with (
        model_patches.enable_packing(model=model),          # packed documents never see each other
        model_patches.enable_linear_cross_entropy(model),       # model(**batch, labels=...) without logits
        ac_policies.apply_policy(model, "full"),             # recompute each decoder block in backward
        tempfile.TemporaryDirectory() as out,
    ):
        config = dict(
            output_dir=out, max_steps=steps, per_device_train_batch_size=8, learning_rate=1e-3, logging_steps=1,
            report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True, remove_unused_columns=False,
        )
        # The policy does the checkpointing: keep Trainer from switching Hugging Face's own on too.
        config[ac_policies.apply.trainer_checkpointing_argument()] = False
        trainer = transformers.Trainer(
            model=model, args=transformers.TrainingArguments(**config), train_dataset=docs,
            data_collator=model_patches.PackingCollator(64),
        )
        trainer.train()
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    assert losses and all(math.isfinite(x) for x in losses), losses
    print(f"loss {losses[-1]:.4f} after {len(losses)} steps (first {losses[0]:.4f})")


if __name__ == "__main__":
    torch.set_num_threads(min(torch.get_num_threads(), 2))
    main()
