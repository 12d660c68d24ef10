"""``ac_policies.estimate``: one training step on fake tensors against the same live-tensor
accounting on the real step (``measure_step``), within 10% of the measured step peak, on tiny
dense, MoE and hybrid (linear-attention) models, with no policy, presets and a fitted policy, the
stock loss and the hidden-state loss. Also: the model is left untouched, a meta-device model runs,
CUDA rounding, errors, and ``fit`` on fake tensors returning the real search's table."""

from __future__ import annotations

import warnings

import pytest
import torch

import ac_policies
from ac_policies.estimate import measure_step
from tests.ac_policies.estimate.workers.fsdp_estimate import prepared_model
from tests.support.tiny_models import tiny_ac_model

SEQ = 64
TOLERANCE = 0.10


def _step(vocab: int, seq: int = SEQ):
    def step(model: torch.nn.Module) -> torch.Tensor:
        ids = torch.randint(0, vocab, (1, seq))
        return model(input_ids=ids, labels=ids).loss

    return step


def _prepared(family: str, policy, hidden_state: bool) -> torch.nn.Module:
    return prepared_model(family, policy, hidden_state)


CASES = [
    ("llama", "none", False), ("llama", "full", True),
    pytest.param("llama", "selective", False, marks=pytest.mark.slow),
    pytest.param("qwen3_moe", "none", True, marks=pytest.mark.slow),
    ("qwen3_moe", "non_moe", False), ("qwen3_moe", "selective", True),
    ("qwen3_next", "full", False), pytest.param("qwen3_next", "non_moe_no_attn", True, marks=pytest.mark.slow),
    ("llama", "long_context", True), ("qwen3_moe", "long_context", False),
]


@pytest.mark.parametrize("family,policy,hidden_state", CASES)
def test_estimate_is_within_10_percent_of_the_measured_step(family, policy, hidden_state):
    model = _prepared(family, policy, hidden_state)
    step = _step(model.config.vocab_size)
    est = ac_policies.estimate(model, step)
    real = measure_step(model, step)
    assert est.fake and not real.fake
    assert (est.params, est.grads, est.optimizer) == (real.params, real.grads, real.optimizer)
    assert abs(est.peak - real.peak) <= TOLERANCE * real.peak, (str(est), str(real))
    # kept bytes (not the target): at these tiny widths one logits-sized storage ([64, 128] fp32,
    # 32 KiB) more or less is a visible share of what a checkpointed model keeps
    assert abs(est.activations - real.activations) <= max(0.15 * real.activations, SEQ * 128 * 4)
    assert est.peak_phase in ("forward", "backward", "optimizer")


def test_the_loss_operators_chunk_workspace_is_counted_and_printed():
    """The hidden-state loss's operators report their chunk buffers: the estimate and the measured
    step both count them, and the table prints them in a row of their own; the stock loss has
    none. (On fake labels every row takes part; the real step's last row of each sequence is
    ignored, and its loop gathers the others: a few ``[tokens, hidden]`` copies more.)"""
    from functional_ce.spec import LINEAR_AUTO_CHUNK_ROWS

    seq = 2 * LINEAR_AUTO_CHUNK_ROWS
    stock = _prepared("llama", "full", False)
    linear = _prepared("llama", "full", True)
    step = _step(linear.config.vocab_size, seq)
    est, real = ac_policies.estimate(linear, step), measure_step(linear, step)
    chunk_logits = LINEAR_AUTO_CHUNK_ROWS * linear.config.vocab_size * 4
    assert real.workspace >= est.workspace >= chunk_logits
    # what the real loop adds: the valid rows gathered and their gradients put back, [tokens, hidden] fp32 each
    assert real.workspace - est.workspace <= 3 * seq * linear.config.hidden_size * 4
    assert "loss chunk workspace" in str(est)
    assert ac_policies.estimate(stock, step).workspace == 0


def test_fitted_policy_estimate_and_fake_fit_match_the_real_ones():
    model = tiny_ac_model("llama")
    ids = torch.randint(0, 128, (1, SEQ), generator=torch.Generator().manual_seed(0))
    real = ac_policies.fit(model, lambda: model(input_ids=ids, labels=ids).loss, 0.7)
    fake = ac_policies.fit(model, _step(128), 0.7, fake=True)
    assert fake.rules == real.rules and fake.estimates == real.estimates
    fake_lines, real_lines = (str(ac_policies.plan(model, p)).splitlines() for p in (fake, real))
    assert fake_lines[2:] == real_lines[2:]  # the rows; the summary line quotes each run's measured peak
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ac_policies.ACPolicyWarning)
        handle = ac_policies.apply_policy(model, fake)
    try:
        est, got = ac_policies.estimate(model, _step(128)), measure_step(model, _step(128))
    finally:
        handle.remove()
    assert abs(est.peak - got.peak) <= TOLERANCE * got.peak


def test_model_is_not_touched():
    model = tiny_ac_model("llama")
    before = {n: (p, p.detach().clone()) for n, p in model.named_parameters()}
    ac_policies.estimate(model, _step(128))
    for n, p in model.named_parameters():
        assert p is before[n][0] and p.grad is None and not isinstance(p.data, torch._subclasses.FakeTensor)
        torch.testing.assert_close(p.detach(), before[n][1], rtol=0, atol=0)


def test_meta_model_at_any_size_allocates_nothing():
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("llama", hidden_size=1024, intermediate_size=4096, num_hidden_layers=2,
                               num_attention_heads=8, num_key_value_heads=2, vocab_size=32000, use_cache=False)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").train()
    est = ac_policies.estimate(model, _step(32000, seq=4096), optimizer="adamw")
    n_params = sum(p.numel() for p in model.parameters())
    assert est.params == 4 * n_params and est.grads == 4 * n_params and est.optimizer >= 8 * n_params
    assert est.peak > est.params + est.optimizer + 4096 * 32000 * 4  # fp32 logits alone
    assert all(p.device.type == "meta" for p in model.parameters())
    text = str(est)
    assert "step peak" in text and "GiB" in text and "not counted" in text


def test_cuda_rounding_and_sharding():
    model = tiny_ac_model("llama")
    cpu = ac_policies.estimate(model, _step(128))
    cuda = ac_policies.estimate(model, _step(128), device="cuda")
    assert cuda.device == "cuda" and cuda.peak >= cpu.peak and cuda.params % 512 == 0
    two = ac_policies.estimate(model, _step(128), world_size=2)
    assert two.params < cpu.params and two.grads < cpu.grads and two.optimizer < cpu.optimizer
    none = ac_policies.estimate(model, _step(128), optimizer=None)
    assert none.optimizer == 0 and none.peak < cpu.peak


@pytest.mark.parametrize("kwargs,error", [
    (dict(world_size=0), ValueError), (dict(device="mps"), ValueError), (dict(optimizer="lion"), ValueError),
])
def test_errors_say_what_to_do(kwargs, error):
    with pytest.raises(error):
        ac_policies.estimate(tiny_ac_model("llama"), _step(128), **kwargs)


def test_eval_mode_and_non_scalar_loss_are_refused():
    model = tiny_ac_model("llama").eval()
    with pytest.raises(ValueError, match="model.train"):
        ac_policies.estimate(model, _step(128))
    model.train()
    with pytest.raises(TypeError, match="one-element"):
        ac_policies.estimate(model, lambda m: m(input_ids=torch.randint(0, 128, (1, 8))).logits)


class _SlicedRecompute(torch.autograd.Function):
    """Runs ``module`` on views of its input taken inside forward (no graph behind them) without
    saving, and recomputes each in backward: the pattern of a hand-written tiled MLP."""

    @staticmethod
    def forward(ctx, x, module):
        ctx.module = module
        ctx.save_for_backward(x)
        with torch.no_grad():
            return torch.cat([module(piece) for piece in x.chunk(2, dim=-2)], dim=-2)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        pieces = []
        for piece, g in zip(x.detach().chunk(2, dim=-2), grad.chunk(2, dim=-2)):
            piece = piece.detach().requires_grad_()
            with torch.enable_grad():
                torch.autograd.backward(ctx.module(piece), g)
            pieces.append(piece.grad)
        return torch.cat(pieces, dim=-2), None


class _BackwardInForward(torch.autograd.Function):
    """A loss that runs its own backward inside forward and checks, in backward, that the incoming
    gradient is 1 (reading a tensor's value): the pattern of a fused logits loss."""

    @staticmethod
    def forward(ctx, x, head, labels):
        x = x.detach().requires_grad_()
        with torch.enable_grad():
            loss = torch.nn.functional.cross_entropy(head(x).float(), labels)
            loss.backward()
        ctx.save_for_backward(x.grad)
        return loss.detach()

    @staticmethod
    def backward(ctx, grad):
        (x_grad,) = ctx.saved_tensors
        if grad != 1.0:
            x_grad = x_grad * grad
        return x_grad, None, None


class _HandTiled(torch.nn.Module):
    def __init__(self, vocab: int = 64, hidden: int = 16):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(hidden, 4 * hidden), torch.nn.GELU(),
                                       torch.nn.Linear(4 * hidden, hidden))
        self.head = torch.nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids):
        h = self.embed(ids)
        h = h + _SlicedRecompute.apply(h, self.mlp)
        return _BackwardInForward.apply(h[0], self.head, ids[0])


def test_custom_functions_that_slice_inside_forward_or_run_backward_in_forward_are_estimated():
    """Views with no graph behind them and a backward inside forward (DeepSpeed's TiledMLP and
    TiledFusedLogitsLoss do both) trace on fake tensors, and the estimate equals the measured step."""
    torch.manual_seed(0)
    model = _HandTiled()
    step = lambda m: m(torch.randint(0, 64, (1, 256)))  # noqa: E731
    real = measure_step(model, step)
    estimated = ac_policies.estimate(model, step)
    assert estimated.peak == real.peak and estimated.activations == real.activations
    assert all(p.grad is None for p in model.parameters())
