"""The architectures of the ``train`` bench section: published configurations, as data.

Each :class:`TrainModel` holds the widths of a released model's ``config.json`` (hidden size,
heads, KV heads, head size, intermediate size, vocabulary, tied or untied embeddings,
soft-capping, RoPE base, norm epsilon). The section builds them with random weights, in fp32,
with fewer decoder layers (and, for the MoE model, fewer experts) where this machine needs it;
the report states what was reduced. Nothing is downloaded.

Which "dense untied" model: Llama-3.2-1B is tied (``tie_word_embeddings: true`` in its
published config), as are Qwen3-0.6B to 4B and Llama-3.2-3B. The first untied dense models
are 7-8B: Llama-3.1-8B (hidden 4096, vocabulary 128256) needs 16.8 GB for the fp32 AdamW state
of its embedding and head alone (4 x 2 x 128256 x 4096 x 4 bytes), past a 24 GB CPU host; it is
in :data:`MODELS` for larger machines (``--train-models llama3.1-8b``). The default dense untied
model is Mistral-7B-v0.3 (hidden 4096, vocabulary 32768, untied).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch


@dataclasses.dataclass(frozen=True)
class TrainModel:
    """One published architecture.

    ``config`` is what ``AutoConfig.for_model(model_type, **config)`` takes, at the published
    widths; ``reduced`` names what the section changes on this machine (layers, experts) and
    is merged over ``config`` when the model is built.
    """

    name: str
    source: str  #: the published checkpoint whose config this is
    model_type: str
    config: dict[str, Any]
    kind: str  #: "dense" or "moe"
    reduced: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: sdpa where Transformers allows it; Gemma 2's soft-capped attention scores need eager.
    attention: str = "sdpa"

    @property
    def tied(self) -> bool:
        return bool(self.config.get("tie_word_embeddings", False))

    def describe(self, layers: int, overrides: Optional[dict[str, Any]] = None) -> str:
        """One line for the report: the source, what is real, what is reduced."""
        c = {**self.config, **self.reduced, **(overrides or {})}
        parts = [f"hidden {c['hidden_size']}", f"{c['num_attention_heads']} heads / {c['num_key_value_heads']} KV",
                 f"vocab {c['vocab_size']}", "tied" if c.get("tie_word_embeddings") else "untied",
                 f"{layers} layer{'s' if layers != 1 else ''} (published {self.config['num_hidden_layers']})"]
        if "num_experts" in c:
            parts.append(f"{c['num_experts']} experts top-{c['num_experts_per_tok']} (published "
                         f"{self.config['num_experts']} top-{self.config['num_experts_per_tok']})")
        if c.get("final_logit_softcapping"):
            parts.append(f"final soft-cap {c['final_logit_softcapping']}")
        parts.append(f"{self.attention} attention")
        return f"{self.name} ({self.source}): " + ", ".join(parts)


MODELS: dict[str, TrainModel] = {
    m.name: m
    for m in (
        TrainModel(
            "qwen3-0.6b", "Qwen/Qwen3-0.6B", "qwen3", kind="dense",
            config=dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                        num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                        rope_theta=1_000_000.0, rms_norm_eps=1e-6, max_position_embeddings=40960),
        ),
        TrainModel(
            "mistral-7b", "mistralai/Mistral-7B-v0.3", "mistral", kind="dense",
            config=dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                        num_key_value_heads=8, head_dim=128, vocab_size=32768, tie_word_embeddings=False,
                        rope_theta=1_000_000.0, rms_norm_eps=1e-5, max_position_embeddings=32768,
                        sliding_window=None),
        ),
        TrainModel(
            "llama3.1-8b", "meta-llama/Llama-3.1-8B", "llama", kind="dense",
            config=dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                        num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False,
                        rope_theta=500_000.0, rms_norm_eps=1e-5, max_position_embeddings=131072),
        ),
        TrainModel(
            "qwen3-30b-a3b", "Qwen/Qwen3-30B-A3B", "qwen3_moe", kind="moe",
            config=dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
                        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                        num_experts_per_tok=8, norm_topk_prob=True, vocab_size=151936, tie_word_embeddings=False,
                        rope_theta=1_000_000.0, rms_norm_eps=1e-6, max_position_embeddings=40960,
                        output_router_logits=False),
            reduced=dict(num_experts=8, num_experts_per_tok=2),
        ),
        TrainModel(
            "gemma2-2b", "google/gemma-2-2b", "gemma2", kind="dense",
            config=dict(hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
                        num_key_value_heads=4, head_dim=256, vocab_size=256000, tie_word_embeddings=True,
                        final_logit_softcapping=30.0, attn_logit_softcapping=50.0, sliding_window=4096,
                        query_pre_attn_scalar=256, rope_theta=10_000.0, rms_norm_eps=1e-6,
                        max_position_embeddings=8192),
            attention="eager",
        ),
    )
}

#: The quick run's model and the ``--full`` run's models (the CPU host's room; see the module doc).
QUICK_MODELS = ["qwen3-0.6b"]
FULL_MODELS = ["qwen3-0.6b", "mistral-7b", "qwen3-30b-a3b", "gemma2-2b"]


def model_entry(name: str) -> TrainModel:
    """The catalog entry ``name``; ``ValueError`` naming the known ones otherwise."""
    if name not in MODELS:
        raise ValueError(f"unknown train model {name!r}; known: {', '.join(MODELS)}")
    return MODELS[name]


def build_model(name: str, layers: int, overrides: Optional[dict[str, Any]] = None, *,
                seed: int = 0) -> torch.nn.Module:
    """``name``'s architecture with ``layers`` decoder layers and random weights (``seed``), fp32,
    in training mode, without a KV cache. ``overrides`` replace config values (tiny widths for tests)."""
    import transformers

    entry = model_entry(name)
    if not isinstance(layers, int) or layers <= 0:
        raise ValueError(f"layers must be a positive int, got {layers!r}")
    values = {**entry.config, **entry.reduced, **(overrides or {}), "num_hidden_layers": layers, "use_cache": False}
    config = transformers.AutoConfig.for_model(entry.model_type, **values)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=entry.attention,
                                                          dtype=torch.float32)
    return model.train()
