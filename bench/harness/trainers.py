"""Offline TRL trainers for the tests: a word-level tokenizer over ``t2 .. t127`` and an
``SFTTrainer`` of a few CPU steps (no hub downloads). Import only after
``pytest.importorskip("trl")``."""

from __future__ import annotations

import os
from typing import Any, Sequence

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

#: Token ids the datasets use: 0 is <pad>, 1 is <eos>.
WORDS = 128


def word_tokenizer():
    """A ``PreTrainedTokenizerFast`` with vocabulary ``<pad>``=0, ``<eos>``=1, ``t2``..``t127``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{f"t{i}": i for i in range(2, WORDS)}}
    words = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", eos_token="<eos>")


def token_rows(n: int = 12, length: int = 16, seed: int = 0, ragged: bool = False) -> list[list[int]]:
    """``n`` rows of random token ids in ``2..WORDS-1`` (lengths ``length // 2 .. length`` if ragged)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(length // 2, length + 1, (n,), generator=g) if ragged else torch.full((n,), length)
    return [torch.randint(2, WORDS, (int(k),), generator=g).tolist() for k in lengths]


def sft_trainer(model: torch.nn.Module, out_dir: Any, rows: Sequence[Sequence[int]], *, steps: int = 3,
                peft_config: Any = None, **config: Any):
    """A ``trl.SFTTrainer`` of ``steps`` CPU steps over ``rows`` (batch 4, fp32, seed 0, a loss
    logged every step); ``config`` overrides ``SFTConfig`` fields; ``peft_config`` goes to the trainer."""
    import trl
    from datasets import Dataset

    settings: dict[str, Any] = dict(
        output_dir=str(out_dir), max_steps=steps, per_device_train_batch_size=4, logging_steps=1,
        report_to="none", use_cpu=True, bf16=False, save_strategy="no", disable_tqdm=True, max_length=32, seed=0,
    )
    settings.update(config)
    data = Dataset.from_dict({"input_ids": [list(r) for r in rows]})
    return trl.SFTTrainer(model=model, args=trl.SFTConfig(**settings), train_dataset=data,
                          processing_class=word_tokenizer(), peft_config=peft_config)


def logged_losses(trainer) -> list[float]:
    """Train, then the loss logged at each step."""
    return [row[0] for row in logged(trainer, "loss")]


def logged(trainer, *keys: str) -> list[tuple[float, ...]]:
    """Train, then ``keys`` of every step's log (the rows that log a loss)."""
    trainer.train()
    return [tuple(row[k] for k in keys) for row in trainer.state.log_history if "loss" in row]


SFT_LAYOUTS: dict[str, dict[str, Any]] = {
    "padded": {},
    "packing": {"packing": True},
    "padding_free": {"padding_free": True, "max_length": None},
}
"""``SFTConfig`` settings of TRL's three batch layouts: padded rows; rows packed by TRL (one row,
restarting ``position_ids``, no attention mask); padding-free rows (the same, unpacked)."""
