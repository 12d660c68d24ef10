"""The tiny random-init Hugging Face models of the test suites, as size tables for
:func:`model_patches.testing.tiny_causal_lm` (no downloads).

- Loss models (``model_patches`` loss tests and the bench; defined in
  :mod:`model_patches.testing.tiny_models`): :data:`LOSS_SIZES` for every family (hidden 64,
  2 layers, vocabulary :data:`LOSS_VOCAB`), :data:`LOSS_FAMILIES` on top; fp32 unless asked
  otherwise, each family's default attention backend, training mode.
- Checkpointing models (``ac_policies`` tests): :data:`AC_SIZES` (hidden 32, 2 layers) with
  :data:`AC_FAMILIES` on top; MoE families get 4 experts, top-2. DeepSeek-V3 and GLM4-MoE keep
  their first layer dense (``first_k_dense_replace=1``); Qwen3-Next alternates linear and full
  attention; GPT-OSS alternates sliding and full attention. :data:`AC_REACH_FAMILIES` are full
  configs of families whose blocks are not ``attention + mlp`` children. fp32, training mode.
"""

from __future__ import annotations

from typing import Any

import torch

from model_patches.testing import tiny_causal_lm
from model_patches.testing.tiny_models import LOSS_FAMILIES, LOSS_SIZES, LOSS_VOCAB, tiny_loss_model  # noqa: F401 - the loss models, re-exported

AC_SIZES: dict[str, Any] = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    vocab_size=128,
    max_position_embeddings=64,
    attention_dropout=0.0,
)

#: model_type -> config overrides on :data:`AC_SIZES` (``None``: the family's default).
AC_FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {},
    "qwen3_moe": dict(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[]),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "deepseek_v3": dict(
        num_key_value_heads=4,
        head_dim=None,
        moe_intermediate_size=32,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        kv_lora_rank=16,
        q_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
    "glm4_moe": dict(moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1),
    "olmoe": dict(num_experts=4, num_experts_per_tok=2, eos_token_id=1, pad_token_id=0),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, layer_types=["sliding_attention", "full_attention"], sliding_window=8),
    "qwen3_next": dict(
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        shared_expert_intermediate_size=32,
        layer_types=["linear_attention", "full_attention"],
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    ),
}
AC_MOE_FAMILIES = [f for f in AC_FAMILIES if f != "llama"]

#: Families whose blocks are not `attention + mlp` children: full configs (no :data:`AC_SIZES`).
#: DBRX nests attention in `norm_attn_norm`; JetMoE routes attention heads (MoA) and experts
#: (parallel expert projections); Nemotron-H has one mixer per block (Mamba-2, MoE, attention,
#: MLP); Qwen3-VL-MoE adds a vision tower whose MLP is `linear_fc1`/`linear_fc2`.
AC_REACH_FAMILIES: dict[str, dict[str, Any]] = {
    "dbrx": dict(
        d_model=32, n_heads=4, n_layers=2, max_seq_len=64, vocab_size=128,
        attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
        ffn_config=dict(ffn_hidden_size=64, moe_num_experts=4, moe_top_k=2),
    ),
    "jetmoe": dict(
        hidden_size=32, num_hidden_layers=2, num_key_value_heads=2, kv_channels=8, intermediate_size=64,
        num_local_experts=4, num_experts_per_tok=2, vocab_size=128, max_position_embeddings=64,
    ),
    "nemotron_h": dict(
        hidden_size=32, layers_block_type=["linear_attention", "moe", "full_attention", "mlp"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=128, max_position_embeddings=64,
        intermediate_size=64, ssm_state_size=8, mamba_num_heads=4, mamba_head_dim=8, n_groups=1, chunk_size=8,
        n_routed_experts=4, n_shared_experts=1, moe_intermediate_size=32, moe_shared_expert_intermediate_size=32,
        num_experts_per_tok=2,
    ),
    "qwen3_vl_moe": dict(
        text_config=dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, vocab_size=128, max_position_embeddings=64, moe_intermediate_size=32, num_experts=4,
            num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[1, 1, 2]),
        ),
        vision_config=dict(
            depth=2, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=32, patch_size=4,
            temporal_patch_size=2, spatial_merge_size=2, deepstack_visual_indexes=[0], num_position_embeddings=16,
        ),
        image_token_id=120, video_token_id=121, vision_start_token_id=122, vision_end_token_id=123,
    ),
}
#: Families built with ``AutoModelForImageTextToText``.
AC_IMAGE_TEXT_FAMILIES = {"qwen3_vl_moe"}


def tiny_ac_model(family: str, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """A tiny fp32 model of ``family`` with seeded random weights, in training mode, for the
    checkpointing tests: a causal LM, or an image-text model for :data:`AC_IMAGE_TEXT_FAMILIES`."""
    full_config = family in AC_REACH_FAMILIES
    model = tiny_causal_lm(
        family, None, seed,
        sizes={} if full_config else AC_SIZES,
        family_sizes=AC_REACH_FAMILIES if full_config else AC_FAMILIES,
        train=True, image_text=family in AC_IMAGE_TEXT_FAMILIES, **overrides,
    )
    return model.float()
