"""Tiny random-init Hugging Face causal LMs (no downloads) and batches for the loss tests."""

from __future__ import annotations

from typing import Any

import torch

VOCAB = 300

#: model_type -> config overrides. Gemma 2/3 tie their embeddings by default and soft-cap logits.
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {},
    "qwen2": {},
    "qwen3": {},
    "mistral": {},
    "gemma2": {"final_logit_softcapping": 5.0},
    "gemma3_text": {"final_logit_softcapping": 5.0},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
    "qwen2_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "shared_expert_intermediate_size": 32},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "gemma": {},
    "olmo2": {},
    "phi3": {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
    "smollm3": {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
}


def tiny_model(model_type: str, dtype: torch.dtype = torch.float32, seed: int = 0, **overrides: Any):
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, max_position_embeddings=256,
    )
    kw.update(FAMILIES.get(model_type, {}))
    kw.update(overrides)
    config = AutoConfig.for_model(model_type, **kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.train()


def padded_batch(seed: int = 0, b: int = 2, t: int = 12) -> dict[str, torch.Tensor]:
    """Right-padded rows: ``input_ids``, ``attention_mask`` and ``labels`` (-100 on padding)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (b, t), generator=g)
    mask = torch.ones(b, t, dtype=torch.long)
    mask[-1, t - 4:] = 0
    labels = torch.where(mask.bool(), ids, -100)
    labels[0, :2] = -100  # a prompt without loss
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def packed_batch(doc_lengths=(5, 7, 4), seed: int = 1) -> dict[str, torch.Tensor]:
    """One packed row: per-document ``position_ids`` and ``shift_labels`` that never cross a document."""
    g = torch.Generator().manual_seed(seed)
    t = sum(doc_lengths)
    ids = torch.randint(0, VOCAB, (1, t), generator=g)
    position_ids = torch.cat([torch.arange(n) for n in doc_lengths]).unsqueeze(0)
    shift = torch.full((1, t), -100)
    start = 0
    for n in doc_lengths:
        shift[0, start:start + n - 1] = ids[0, start + 1:start + n]
        start += n
    return {"input_ids": ids, "position_ids": position_ids, "shift_labels": shift}


def grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out
