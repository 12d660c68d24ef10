"""The packing oracle over every causal-LM family Transformers can build: correct, refused, or a leak.

:func:`sweep_family` builds a tiny random-init model of one ``model_type`` (hidden 64, 2 layers,
no download), runs the packed batch of :mod:`model_patches.packing_oracle` and classifies:

- ``"correct"``: packed logits equal each document alone (max gap <= ``tol``, fp32);
- ``"refused"``: ``enable_packing(model=...)`` (or, with ``use_model=False``, the forward under
  plain ``enable_packing()``) raised an error that names a reason;
- ``"leak"``: neither: packing was accepted and documents saw each other (the failure);
- ``"not built"``: the family cannot be built or run from ``input_ids`` alone at tiny size on
  CPU (multimodal heads needing pixels, encoder-decoders, ...); ``detail`` says why.

Shared by ``tests/test_packing_families.py`` and ``python -m bench --only packing``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import warnings
from typing import Any, Optional

import torch

from .packing_oracle import logits_gap, packed_batch

__all__ = ["SweepResult", "causal_lm_families", "tiny_causal_lm", "sweep_family"]

_OVERRIDES: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=64,
    attention_dropout=0.0, hidden_dropout=0.0, dropout=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
    attn_pdrop=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, top_k=2,
    moe_intermediate_size=32, shared_expert_intermediate_size=32, decoder_sparse_step=1,
)
_MAX_PARAMS = 8_000_000

#: One gated-delta-net layer, then one attention layer, with small linear-attention heads.
_GATED_DELTA_NET: dict[str, Any] = dict(
    layer_types=["linear_attention", "full_attention"], linear_num_value_heads=4, linear_num_key_heads=2,
    linear_key_head_dim=16, linear_value_head_dim=16,
)

#: Hybrid families default to layer patterns whose first two layers hold no attention at all;
#: give the tiny model one mixer layer and one attention layer, and small state sizes.
FAMILY_OVERRIDES: dict[str, dict[str, Any]] = {
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


@dataclasses.dataclass(frozen=True)
class SweepResult:
    """One family's outcome: ``outcome`` in correct / refused / leak / not built."""

    family: str
    outcome: str
    gap: Optional[float] = None
    detail: str = ""
    stock_gap: Optional[float] = None  # the same batch without packing (documents leak there)
    #: capabilities packing makes document-aware in this family (``alibi``, ``stateful_mixer``);
    #: empty for families whose only sequence mixer is masked attention
    made_correct: tuple[str, ...] = ()


def causal_lm_families() -> list[str]:
    """Every ``model_type`` with an ``AutoModelForCausalLM`` entry in the installed Transformers."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def tiny_causal_lm(model_type: str, implementation: Optional[str] = "eager", seed: int = 0,
                   drop: tuple[str, ...] = (), **overrides: Any) -> torch.nn.Module:
    """A random-init fp32 causal LM of ``model_type`` at tiny size, eval mode. Raises on failure.

    ``implementation``: the attention backend, or None for the family's own default (sdpa where
    it supports it). ``drop``: generic overrides left at the family's defaults (e.g. ``head_dim``);
    ``overrides``: more config values (``alibi=True``).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    generic = {k: v for k, v in _OVERRIDES.items() if k not in drop}
    config = AutoConfig.for_model(model_type, **{**generic, **FAMILY_OVERRIDES.get(model_type, {}), **overrides})
    with torch.device("meta"):  # count first: some configs keep large sizes the overrides miss
        n = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    if n > _MAX_PARAMS:
        raise ValueError(f"{n} parameters at the tiny overrides (over {_MAX_PARAMS})")
    torch.manual_seed(seed)
    kwargs = {"attn_implementation": implementation} if implementation else {}
    model = AutoModelForCausalLM.from_config(config, **kwargs)
    return model.eval()


@contextlib.contextmanager
def _quiet():
    level = logging.getLogger("transformers").level
    logging.getLogger("transformers").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            yield
        finally:
            logging.getLogger("transformers").setLevel(level)


def sweep_family(model_type: str, use_model: bool = True, tol: float = 1e-4,
                 batch: Optional[dict[str, torch.Tensor]] = None, with_stock: bool = False,
                 **overrides: Any) -> SweepResult:
    """Classify ``model_type`` under packing (see module docstring).

    The packed forward runs on the family's default attention backend (sdpa where supported;
    some families, e.g. those with attention sinks, only compute correctly on eager).
    ``with_stock``: also measure the same batch without packing (``stock_gap``).
    """
    from .capabilities import capabilities_for_config
    from .packing import enable_packing

    batch = batch if batch is not None else packed_batch()
    with _quiet():
        model, failure = None, ""
        for drop in ((), ("head_dim", "num_key_value_heads")):  # second try: the family's own head sizes
            try:
                model = tiny_causal_lm(model_type, None, drop=drop, **overrides)
                with torch.no_grad():
                    model(input_ids=batch["input_ids"][:1, :4])
                break
            except Exception as exc:  # noqa: BLE001 - any failure to build or run means "not built"
                model, failure = None, f"{type(exc).__name__}: {str(exc)[:160]}"
        if model is None:
            return SweepResult(model_type, "not built", detail=failure)
        handle = None
        implementation = model.config._attn_implementation or "eager"
        stock = None
        if with_stock:
            try:
                stock = logits_gap(model, batch, implementation)
            except Exception:  # noqa: BLE001 - a stock forward that rejects the mask has no stock gap
                stock = None
        try:
            handle = enable_packing(model=model) if use_model else enable_packing()
            gap = logits_gap(model, batch, implementation)
        except (ValueError, RuntimeError) as exc:
            message = str(exc)
            if "pack" in message and ("Fix" in message or "refused" in message or "not supported" in message):
                return SweepResult(model_type, "refused", detail=message.split(". ")[0][:200], stock_gap=stock)
            return SweepResult(model_type, "not built", detail=f"{type(exc).__name__}: {message[:160]}")
        except Exception as exc:  # noqa: BLE001 - a forward that cannot run packed at all
            return SweepResult(model_type, "not built", detail=f"{type(exc).__name__}: {str(exc)[:160]}")
        finally:
            if handle is not None:
                handle.remove()
    outcome = "correct" if gap <= tol else "leak"
    made = tuple(c.name for c in capabilities_for_config(model.config) if c.targets_for(model_type))
    return SweepResult(model_type, outcome, gap=gap, detail=implementation, stock_gap=stock, made_correct=made)
