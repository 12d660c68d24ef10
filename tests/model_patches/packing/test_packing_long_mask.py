"""The packing patch on sdpa/eager builds a dense ``[B, 1, T, T]`` document mask; past
``LARGE_MASK_BYTES`` it says so once, with the backends that take the documents instead."""

from __future__ import annotations

import logging

import torch

import model_patches
from model_patches.packing import mask_builders
from tests.support.tiny_models import tiny_ac_model


def test_a_large_dense_packed_mask_is_reported_once_with_the_backends_that_avoid_it(monkeypatch, caplog):
    monkeypatch.setattr(mask_builders, "LARGE_MASK_BYTES", 1024)
    monkeypatch.setattr(mask_builders, "_mask_reported", False)
    model = tiny_ac_model("llama", attn_implementation="sdpa").eval()
    ids = torch.randint(3, 100, (1, 64))
    docs = torch.tensor([[1] * 30 + [2] * 34])  # two documents, indexed mask
    with model_patches.enable_packing(model), caplog.at_level(logging.WARNING, logger=mask_builders.__name__):
        model(input_ids=ids, attention_mask=docs)
        model(input_ids=ids, attention_mask=docs)
    said = [r.getMessage() for r in caplog.records if "document mask" in r.getMessage()]
    assert len(said) == 1
    assert "[1, 1, 64, 64]" in said[0] and "flex_attention" in said[0] and "flash_attention_2/3" in said[0]
