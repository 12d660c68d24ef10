"""TRL's ``GRPOTrainer`` with its fused LM head computed by functional_ce
(``model_patches.enable_trl_heads()``): log-probs and entropy from hidden states, chunk by chunk,
the same values as TRL's own kernel. A tiny random Llama and a word-level tokenizer, offline.

    python examples/grpo_trl_heads.py --tiny
"""

from __future__ import annotations

import argparse
import math
import pathlib
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from _tiny import documents, tiny_model, word_tokenizer  # noqa: E402

import model_patches  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="2 steps, 8-token completions")
    args = parser.parse_args()
    import trl
    from datasets import Dataset

    prompts = [" ".join(f"t{i}" for i in doc) for doc in documents(8, low=6, high=6)]

    def reward(completions, **_):  # longer completions score higher
        return [float(len(c)) for c in completions]

    with model_patches.enable_trl_heads(), tempfile.TemporaryDirectory() as out:
        config = trl.GRPOConfig(
            output_dir=out, max_steps=2 if args.tiny else 50, per_device_train_batch_size=4, num_generations=2,
            max_completion_length=8, report_to="none", use_cpu=True, bf16=False, save_strategy="no",
            disable_tqdm=True, logging_steps=1, seed=0,
        )
        trainer = trl.GRPOTrainer(model=tiny_model("llama"), reward_funcs=[reward], args=config,
                                  train_dataset=Dataset.from_dict({"prompt": prompts}),
                                  processing_class=word_tokenizer())
        trainer.train()
        print(model_patches.trl_heads_status())
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    assert losses and all(math.isfinite(x) for x in losses), losses
    print(f"loss {losses[-1]:.4f} after {len(losses)} steps")


if __name__ == "__main__":
    main()
