"""MoE load-balancing loss under packing: each real token counts once, as if each document ran alone.

Reference: run every document alone, concatenate its router logits (real tokens only) layer by
layer, and compute the family's own ``load_balancing_loss_func`` on them without a mask. The
packed batch under ``enable_packing`` must give the same aux loss within 1e-6 relative; stock
Transformers (document k weighted k times) must not, or the comparison proves nothing.
"""

from __future__ import annotations

import functools
import importlib

import pytest
import torch

from model_patches import enable_packing
from model_patches.testing.packing_oracle import documents, packed_batch
from tests.support.tiny_models import tiny_loss_model

AUX_LOSS_FAMILIES = ["qwen3_moe", "mixtral", "qwen2_moe"]


@functools.lru_cache(maxsize=None)
def _model(family: str) -> torch.nn.Module:
    model = tiny_loss_model(family, vocab_size=128, output_router_logits=True).eval()
    model.config.output_router_logits = True
    return model


def _aux(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                    position_ids=batch["position_ids"], output_router_logits=True, use_cache=False)
    return out.aux_loss


def _reference(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    per_layer: list[list[torch.Tensor]] = []
    with torch.no_grad():
        for r, s, e in documents(batch):
            out = model(input_ids=batch["input_ids"][r : r + 1, s:e], position_ids=batch["position_ids"][r : r + 1, s:e],
                        output_router_logits=True, use_cache=False)
            for i, logits in enumerate(out.router_logits):
                if len(per_layer) <= i:
                    per_layer.append([])
                per_layer[i].append(logits.reshape(e - s, -1))
    module = importlib.import_module(type(model).__module__)
    cfg = model.config
    experts = getattr(cfg, "num_experts", None) or cfg.num_local_experts
    return module.load_balancing_loss_func(
        tuple(torch.cat(chunks) for chunks in per_layer), experts, cfg.num_experts_per_tok, None
    )


@pytest.mark.parametrize("family", AUX_LOSS_FAMILIES)
def test_aux_loss_counts_each_real_token_once(family: str) -> None:
    model, batch = _model(family), packed_batch()
    assert int(batch["attention_mask"].max()) > 1
    reference = _reference(model, batch)
    stock = _aux(model, batch)
    assert abs(float(stock - reference)) > 1e-4 * abs(float(reference)), "stock did not miscount: no control"
    with enable_packing():
        packed = _aux(model, batch)
        # a float 0/1 mask with packed position_ids: the position resets mark the same documents
        padded = {**batch, "attention_mask": (batch["attention_mask"] != 0).float()}
        torch.testing.assert_close(_aux(model, padded), packed, rtol=1e-6, atol=0.0)
    rel = abs(float(packed - reference)) / abs(float(reference))
    assert rel <= 1e-6, f"{family}: aux loss {float(packed):.8g} vs per-document {float(reference):.8g} (rel {rel:.2g})"
