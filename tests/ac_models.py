"""Tiny random-init Hugging Face models for the ac_policies tests (no downloads).

Every family is built with ``AutoConfig.for_model`` at hidden size 32 and 2 layers; MoE
families get 4 experts, top-2. DeepSeek-V3 and GLM4-MoE keep their first layer dense
(``first_k_dense_replace=1``); Qwen3-Next alternates linear and full attention; GPT-OSS
alternates sliding and full attention.
"""

from __future__ import annotations

import torch

_COMMON = dict(
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

FAMILIES: dict[str, dict] = {
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
MOE_FAMILIES = [f for f in FAMILIES if f != "llama"]

# Families whose blocks are not `attention + mlp` children: full configs (no _COMMON).
# DBRX nests attention in `norm_attn_norm`; JetMoE routes attention heads (MoA) and experts
# (parallel expert projections); Nemotron-H has one mixer per block (Mamba-2, MoE, attention,
# MLP); Qwen3-VL-MoE adds a vision tower whose MLP is `linear_fc1`/`linear_fc2`.
REACH: dict[str, dict] = {
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
MULTIMODAL = {"qwen3_vl_moe"}


def build(family: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """A tiny fp32 causal LM of ``family`` with seeded random weights, in training mode."""
    import transformers

    kw = {**REACH[family], **overrides} if family in REACH else {**_COMMON, **FAMILIES[family], **overrides}
    kw = {k: v for k, v in kw.items() if v is not None}
    cfg = transformers.AutoConfig.for_model(family, **kw)
    torch.manual_seed(seed)
    auto = transformers.AutoModelForImageTextToText if family in MULTIMODAL else transformers.AutoModelForCausalLM
    model = auto.from_config(cfg)
    return model.float().train()


def image_batch(seed: int = 0, text: int = 6) -> dict[str, torch.Tensor]:
    """Inputs for the tiny Qwen3-VL-MoE: one 8x8-patch image (16 patches -> 4 tokens) inside text."""
    g = torch.Generator().manual_seed(seed)
    cfg = REACH["qwen3_vl_moe"]
    patch = 3 * 2 * 4 * 4  # channels x temporal patch x patch x patch
    ids = torch.randint(2, 120, (1, text), generator=g)
    image = torch.tensor([[cfg["vision_start_token_id"]] + [cfg["image_token_id"]] * 4 + [cfg["vision_end_token_id"]]])
    input_ids = torch.cat([ids[:, :2], image, ids[:, 2:]], dim=1)
    return {
        "input_ids": input_ids,
        "labels": input_ids,
        "mm_token_type_ids": (input_ids == cfg["image_token_id"]).int(),  # 1: image, 0: text
        "pixel_values": torch.randn(16, patch, generator=g),
        "image_grid_thw": torch.tensor([[1, 4, 4]]),
    }


def batch(seed: int = 0, b: int = 2, s: int = 12, vocab: int = 128) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (b, s), generator=g)


def loss_and_grads(model: torch.nn.Module, ids: torch.Tensor, **kwargs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One forward+backward with labels = ids; returns the loss and every parameter's gradient."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1234)
    out = model(input_ids=ids, labels=ids, **kwargs)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach(), grads
