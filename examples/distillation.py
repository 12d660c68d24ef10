"""Distillation of a causal LM into a smaller one with TRL GKD's generalized Jensen-Shannon
divergence, computed from both models' hidden states (the ``[B, T, V]`` logits are never built).

    python examples/distillation.py --tiny
"""

from __future__ import annotations

import argparse
import math
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import torch  # noqa: E402
from _tiny import VOCAB, tiny_model  # noqa: E402

import model_patches  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="hidden sizes 32 and 48, 3 steps")
    args = parser.parse_args()
    steps = 3 if args.tiny else 100
    student = tiny_model("llama", seed=0)
    teacher = tiny_model("qwen3", seed=1, hidden_size=48, head_dim=12).eval()  # another hidden size: fine
    optimizer = torch.optim.AdamW(student.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    for step in range(steps):
        ids = torch.randint(2, VOCAB, (4, 16), generator=g)
        labels = ids.clone()
        labels[:, :4] = -100  # the prompt: only completion tokens are distilled
        loss = model_patches.causal_lm_distillation_loss(
            student, teacher, input_ids=ids, labels=labels, beta=0.5, temperature=0.9,
        )
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        assert math.isfinite(loss.item())
        print(f"step {step}: loss {loss.item():.4f}")
    print(f"loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
