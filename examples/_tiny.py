"""Shared by the examples: a tiny random-weight causal LM and a word-level tokenizer, both built
offline (no hub downloads), so every example runs in seconds on a CPU."""

from __future__ import annotations

import os

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

#: Token ids of the tiny vocabulary: 0 is <pad>, 1 is <eos>, then the words t2 .. t127.
VOCAB = 128


def tiny_model(model_type: str = "llama", *, seed: int = 0, **overrides):
    """A 2-layer ``model_type`` causal LM with hidden size 32 and random weights, fp32, training mode."""
    import transformers

    sizes = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256, pad_token_id=0,
                 eos_token_id=1, bos_token_id=1)
    sizes.update(overrides)
    config = transformers.AutoConfig.for_model(model_type, **sizes)
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float().train()


def word_tokenizer():
    """A ``PreTrainedTokenizerFast`` over ``<pad>``, ``<eos>`` and ``t2`` .. ``t127``, whitespace-split."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{f"t{i}": i for i in range(2, VOCAB)}}
    words = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", eos_token="<eos>")


def documents(n: int, *, low: int = 4, high: int = 12, seed: int = 0) -> list[list[int]]:
    """``n`` random documents of ``low`` .. ``high`` token ids in ``2 .. VOCAB - 1``."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high + 1, (n,), generator=g)
    return [torch.randint(2, VOCAB, (int(k),), generator=g).tolist() for k in lengths]
