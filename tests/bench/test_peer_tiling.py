"""The peer's pieces of the train section (``bench/sections/train/peer_tiling.py``): DeepSpeed's
``TiledMLP`` and ``TiledFusedLogitsLoss`` on a Hugging Face model give stock's loss and gradients,
and the estimate on fake tensors equals the measured step, so the peer's longest context is
estimated as the library's is. Skipped without DeepSpeed (``pip install '.[engines]'``)."""

from __future__ import annotations

import copy

import pytest
import torch

import ac_policies
from ac_policies.estimate import measure_step, token_step
from bench.sections.train.peer_tiling import apply_deepspeed_tiling, deepspeed_tiling_available
from tests.support.tiny_models import tiny_ac_model

pytestmark = pytest.mark.skipif(not deepspeed_tiling_available(), reason="DeepSpeed is not installed")


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe"])
def test_the_peer_pieces_give_stock_loss_and_gradients(family):
    torch.manual_seed(0)
    stock = tiny_ac_model(family, num_hidden_layers=2).float()
    peer = apply_deepspeed_tiling(copy.deepcopy(stock))
    ids = torch.randint(0, stock.config.vocab_size, (2, 150))  # 2 rows: 300 tokens, shards of `hidden`
    labels = ids.clone()
    labels[0, :20] = -100
    want = stock(input_ids=ids, labels=labels).loss
    want.backward()
    got = peer(input_ids=ids, labels=labels).loss
    got.backward()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    for (name, a), b in zip(stock.named_parameters(), peer.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_the_peer_step_is_estimated_exactly():
    model = apply_deepspeed_tiling(tiny_ac_model("qwen3", num_hidden_layers=2))
    step = token_step(model.config.vocab_size)(2048)
    assert ac_policies.estimate(model, step).peak == measure_step(model, step).peak
