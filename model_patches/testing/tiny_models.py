"""One factory of tiny random-init Hugging Face models, sized on the meta device first.

Every suite (the packing oracle, the family sweep, the loss and checkpointing tests, the bench)
builds its models here and differs only in the sizes it passes: ``sizes`` for every family,
``family_sizes[model_type]`` on top, then the call's own overrides. A ``None`` value leaves that
setting at the family's default. Nothing is downloaded: configs come from
``AutoConfig.for_model`` and weights from ``torch.manual_seed(seed)``.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch

__all__ = ["SWEEP_SIZES", "SWEEP_FAMILY_SIZES", "MAX_PARAMETERS", "tiny_config", "tiny_causal_lm"]

#: Sizes that build nearly every causal-LM family at hidden 64, 2 layers, no dropout (the sweep).
SWEEP_SIZES: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=64,
    attention_dropout=0.0, hidden_dropout=0.0, dropout=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
    attn_pdrop=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, top_k=2,
    moe_intermediate_size=32, shared_expert_intermediate_size=32, decoder_sparse_step=1,
)

#: One gated-delta-net layer, then one attention layer, with small linear-attention heads.
_GATED_DELTA_NET: dict[str, Any] = dict(
    layer_types=["linear_attention", "full_attention"], linear_num_value_heads=4, linear_num_key_heads=2,
    linear_key_head_dim=16, linear_value_head_dim=16,
)

#: Hybrid families default to layer patterns whose first two layers hold no attention at all;
#: give the tiny model one mixer layer and one attention layer, and small state sizes.
SWEEP_FAMILY_SIZES: dict[str, dict[str, Any]] = {
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                  mamba_d_state=8, mamba_dt_rank=8, use_mamba_kernels=False),
    "bamba": dict(attn_layer_indices=[1], mamba_n_heads=4, mamba_d_state=8, mamba_d_head=32),
    "mamba2": dict(num_heads=8, head_dim=16, n_groups=1, state_size=16, chunk_size=8),
    "falcon_h1": dict(mamba_n_heads=4, mamba_d_state=8, mamba_d_head=32, mamba_d_ssm=128),
    "granitemoehybrid": dict(layer_types=["mamba", "attention"], mamba_n_heads=4, mamba_d_state=8, mamba_d_head=32),
    "nemotron_h": dict(layers_block_type=["mamba", "attention"], mamba_num_heads=4, ssm_state_size=8,
                       mamba_head_dim=32, n_groups=1),
    "zamba": dict(attn_layer_period=2, attn_layer_offset=1, mamba_d_state=8),
    "zamba2": dict(layers_block_type=["mamba", "hybrid"], mamba_d_state=8, mamba_headdim=16),
    "qwen3_next": _GATED_DELTA_NET,
    "lfm2": dict(full_attn_idxs=[1]),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=0),
    "bailing_hybrid": dict(layer_types=["linear_attention", "full_attention"], num_key_value_heads=4),
    "qwen3_5_text": _GATED_DELTA_NET,
    "qwen3_5_moe_text": _GATED_DELTA_NET,
    "qwen4_exp_text": _GATED_DELTA_NET,
    "kimi_linear": dict(layer_types=["linear_attention", "full_attention"], num_key_value_heads=4),
}

#: A "tiny" model larger than this means the sizes missed a setting of its family.
MAX_PARAMETERS = 8_000_000


def tiny_config(model_type: str, *, sizes: Mapping[str, Any] = SWEEP_SIZES,
                family_sizes: Mapping[str, Mapping[str, Any]] = SWEEP_FAMILY_SIZES,
                drop: tuple[str, ...] = (), **overrides: Any) -> Any:
    """``AutoConfig.for_model(model_type, ...)`` from ``sizes`` (less ``drop``), then
    ``family_sizes[model_type]``, then ``overrides``; ``None`` values are left out."""
    from transformers import AutoConfig

    values = {k: v for k, v in sizes.items() if k not in drop}
    values.update(family_sizes.get(model_type, {}))
    values.update(overrides)
    return AutoConfig.for_model(model_type, **{k: v for k, v in values.items() if v is not None})


def tiny_causal_lm(
    model_type: str,
    implementation: Optional[str] = "eager",
    seed: int = 0,
    drop: tuple[str, ...] = (),
    *,
    sizes: Mapping[str, Any] = SWEEP_SIZES,
    family_sizes: Mapping[str, Mapping[str, Any]] = SWEEP_FAMILY_SIZES,
    dtype: Optional[torch.dtype] = None,
    train: bool = False,
    image_text: bool = False,
    max_parameters: int = MAX_PARAMETERS,
    **overrides: Any,
) -> torch.nn.Module:
    """A random-init causal LM of ``model_type`` at tiny size (eval mode unless ``train``).

    ``implementation``: the attention backend, or None for the family's own default (sdpa where
    it supports it). ``drop``: settings of ``sizes`` left at the family's defaults (``head_dim``).
    ``dtype``: the parameters' dtype at construction (default fp32). ``image_text``: build with
    ``AutoModelForImageTextToText`` (vision-language families). Raises ``ValueError`` when the
    model would hold more than ``max_parameters`` (counted on the meta device, before any
    memory is spent), and whatever Transformers raises for a family it cannot build.
    """
    import transformers

    config = tiny_config(model_type, sizes=sizes, family_sizes=family_sizes, drop=drop, **overrides)
    auto = transformers.AutoModelForImageTextToText if image_text else transformers.AutoModelForCausalLM
    with torch.device("meta"):  # count first: some configs keep large sizes the overrides miss
        n = sum(p.numel() for p in auto.from_config(config).parameters())
    if n > max_parameters:
        raise ValueError(f"{n} parameters at the tiny overrides (over {max_parameters})")
    torch.manual_seed(seed)
    kwargs: dict[str, Any] = {"attn_implementation": implementation} if implementation else {}
    if dtype is not None:
        kwargs["dtype"] = dtype
    model = auto.from_config(config, **kwargs)
    return model.train() if train else model.eval()


#: The loss tests' and the bench's tiny models: hidden 64, 2 layers, this vocabulary.
LOSS_VOCAB = 300

LOSS_SIZES: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, vocab_size=LOSS_VOCAB, max_position_embeddings=256,
)

#: model_type -> config overrides. Gemma 2/3 tie their embeddings by default and soft-cap logits.
LOSS_FAMILIES: dict[str, dict[str, Any]] = {
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


def tiny_loss_model(model_type: str, dtype: torch.dtype = torch.float32, seed: int = 0,
                    **overrides: Any) -> torch.nn.Module:
    """A tiny causal LM of ``model_type`` in ``dtype`` with seeded random weights, in training mode.

    An override of ``None`` switches that setting off on the built model's config (for settings
    read in forward, such as ``final_logit_softcapping=None``: no soft-capping).
    """
    switched_off = [name for name, value in overrides.items() if value is None]
    model = tiny_causal_lm(model_type, None, seed, sizes=LOSS_SIZES, family_sizes=LOSS_FAMILIES,
                           dtype=dtype, train=True, **overrides)
    for name in switched_off:
        setattr(model.config, name, None)
    return model
