"""The model the ``ac`` and ``ac_budgets`` sections measure: a small Qwen3-MoE (imported by
both, so it lives apart from either)."""

from __future__ import annotations

from typing import Any

import torch


def model_config(seq: int, layers: int, **overrides: Any) -> dict[str, Any]:
    """A small Qwen3-MoE: hidden 256, 8 query heads x 64 (2x hidden, as in Qwen3), 4 KV heads,
    8 experts top-2 with intermediate 128, vocabulary 1024, sdpa attention, fp32."""
    cfg = dict(
        hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_experts=8, num_experts_per_tok=2,
        decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=layers, num_attention_heads=8,
        num_key_value_heads=4, head_dim=64, vocab_size=1024, max_position_embeddings=seq, use_cache=False,
    )
    cfg.update(overrides)
    return cfg


def build(cfg: dict[str, Any], device: str) -> torch.nn.Module:
    import transformers

    config = transformers.AutoConfig.for_model("qwen3_moe", **cfg)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).float().to(device).train()
