"""``ac_policies.longest_context``: the longest sequence whose step fits a budget, on fake tensors.

Checked against real steps: the answer's measured step fits the budget and the length reported
too long does not (and is at most ``resolution`` times the answer). The depth extrapolation
equals the full-depth estimate on dense, MoE-with-dense-prefix, hybrid and alternating-attention
families. The recommended plan reaches further than the model as it is. The CPU-offload and
checkpoint-offload models move parameters, gradients, optimizer state and checkpoints off the
device.
"""

from __future__ import annotations

import warnings

import pytest

import ac_policies
from ac_policies.estimate import measure_step, token_step
from ac_policies.estimate.depth import decoder_layout, estimate_at_depth
from tests.ac_policies.estimate.workers.fsdp_estimate import prepared_model
from tests.support.tiny_models import tiny_ac_model

DEEP = {
    "llama": dict(num_hidden_layers=6),
    "deepseek_v3": dict(num_hidden_layers=5),  # one dense layer, then MoE layers
    "qwen3_next": dict(num_hidden_layers=8, layer_types=["linear_attention", "full_attention"] * 4),
    "gpt_oss": dict(num_hidden_layers=8, layer_types=["sliding_attention", "full_attention"] * 4),
}
LAYOUTS = {"llama": (0, 1), "deepseek_v3": (1, 1), "qwen3_next": (0, 2), "gpt_oss": (0, 2)}


@pytest.mark.parametrize("family", list(DEEP))
def test_depth_extrapolation_equals_the_full_depth_estimate(family):
    model = tiny_ac_model(family, **DEEP[family])
    layout = decoder_layout(model)
    assert (layout.prefix, layout.period) == LAYOUTS[family] and layout.reducible
    step = token_step(model.config.vocab_size)(128)
    full = ac_policies.estimate(model, step)
    extrapolated = estimate_at_depth(model, lambda: ac_policies.estimate(model, step), layout)
    for field in ("params", "grads", "optimizer", "activations", "peak"):
        assert abs(getattr(extrapolated, field) - getattr(full, field)) <= 0.01 * getattr(full, field), field
    assert len(model.model.layers) == DEEP[family]["num_hidden_layers"]  # put back
    assert model.config.num_hidden_layers == DEEP[family]["num_hidden_layers"]


def test_the_answer_fits_and_the_next_length_does_not_on_real_steps():
    model = prepared_model("llama", "full", True, num_hidden_layers=4)
    make = token_step(model.config.vocab_size)
    budget = 24 * 2**20
    found = ac_policies.longest_context(model, make, budget, device=None, start=256, recommend=False)
    row = found.rows[0]
    assert row.tokens >= 256 and row.too_long <= 1.25 * row.tokens
    assert measure_step(model, make(row.tokens)).peak <= budget
    assert measure_step(model, make(row.too_long)).peak > budget
    assert "longest context within 24.00 MiB" in str(found)


def test_the_recommended_plan_reaches_further_and_the_model_is_left_as_it_was():
    model = tiny_ac_model("llama", num_hidden_layers=4)
    found = ac_policies.longest_context(model, token_step(model.config.vocab_size), 16 * 2**20, device=None, start=256)
    as_is, recommended = found.rows
    assert recommended.plan == "+ long_context + hidden-state loss"
    assert recommended.tokens > 2 * as_is.tokens
    assert ac_policies.policy_of(model) is None
    assert "forward" not in model.__dict__  # the loss patch is gone too


def test_offloaded_parameters_and_checkpoints_leave_the_device():
    model = tiny_ac_model("llama", num_hidden_layers=4)
    step = token_step(model.config.vocab_size)(512)
    # long_context without its offload row: what the blocks keep stays on the device
    on_device = [r for r in ac_policies.PRESETS["long_context"].rules if r.action != "offload"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ac_policies.ACPolicyWarning)
        with ac_policies.apply_policy(model, on_device):
            kept = ac_policies.estimate(model, step, device="cuda")
            on_host = ac_policies.estimate(model, step, device="cuda", offload_params=True)
        with ac_policies.apply_policy(model, "long_context"):
            offloaded = ac_policies.estimate(model, step, device="cuda")
    assert (on_host.params, on_host.grads, on_host.optimizer) == (0, 0, 0)
    assert on_host.peak < kept.peak - kept.optimizer  # the optimizer step runs in host memory
    assert "host memory" in str(on_host)
    hidden = model.config.hidden_size * 512 * 4  # one block's input
    assert offloaded.activations <= kept.activations - 3 * hidden


def test_errors():
    model = tiny_ac_model("llama")
    with pytest.raises(ValueError, match="resolution"):
        ac_policies.longest_context(model, token_step(10), "1GB", resolution=3.0)
    with pytest.raises(ValueError, match="not a fraction"):
        ac_policies.longest_context(model, token_step(10), 0.5)


def test_the_command_prints_the_longest_context_table(tmp_path, capsys):
    import importlib
    import json

    command = importlib.import_module("ac_policies.estimate.__main__")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                    num_attention_heads=4, num_key_value_heads=2, vocab_size=256)))
    assert command.main([str(path), "--longest", "--budget", "16MiB", "--device", "cuda", "--dtype", "fp32",
                         "--offload-params"]) == 0
    out = capsys.readouterr().out
    assert "longest context within 16.00 MiB per process, parameters, gradients and optimizer state in host memory" in out
    assert "+ long_context + hidden-state loss" in out
    with pytest.raises(SystemExit):
        command.main([str(path), "--longest"])  # --longest needs --budget


def test_sharding_the_sequence_reaches_further_and_the_command_says_so(tmp_path, capsys, monkeypatch):
    """``context_parallel=P``: lengths are the whole sequence's, each process's step traced on its
    share against every process's keys and values (the all-gather) with the attention in blocks of
    queries (here past 2^20 scores, as past 2^26 at real lengths); twice the processes, twice the
    length."""
    import importlib
    import json

    from model_patches.context_parallel import enable

    monkeypatch.setattr(enable, "MASK_ELEMENTS", 1 << 20)
    model = prepared_model("llama", "full", True, num_hidden_layers=2)
    model.config._attn_implementation = "sdpa"
    make = token_step(model.config.vocab_size)
    found = {p: ac_policies.longest_context(model, make, 12 * 2**20, device=None, start=256, recommend=False,
                                            context_parallel=p, resolution=2.0) for p in (1, 2)}
    assert found[2].tokens >= 2 * found[1].tokens
    assert "sharded over 2 processes" in str(found[2]) and model.config._attn_implementation == "sdpa"
    with pytest.raises(ValueError, match="context_parallel"):
        ac_policies.estimate(model, make(256), context_parallel=0)
    command = importlib.import_module("ac_policies.estimate.__main__")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                    num_attention_heads=4, num_key_value_heads=2, vocab_size=256)))
    assert command.main([str(path), "--tokens", "1024", "--context-parallel", "4", "--device", "cpu"]) == 0
    assert "the sequence sharded over 4 processes (one's shard)" in capsys.readouterr().out


def test_a_predicted_too_long_length_does_not_fit_on_a_real_step():
    """Past a few thousand tokens the search traces its answer and predicts the next length over
    the budget from the quadratic in length; both hold on real steps."""
    model = prepared_model("llama", "long_context", True, num_hidden_layers=4)
    make = token_step(model.config.vocab_size)
    budget = 12 * 2**20
    row = ac_policies.longest_context(model, make, budget, device=None, start=256, recommend=False).rows[0]
    assert row.too_long_predicted and not (row.fits.note or "").startswith("extrapolated in length")
    assert row.tokens >= 4096 and row.tokens < row.too_long <= 1.05 * row.tokens  # finer than the halving's 1.25x
    assert measure_step(model, make(row.tokens)).peak <= budget
    measured_over = measure_step(model, make(row.too_long)).peak
    assert measured_over > budget
    assert abs(row.over.peak - measured_over) <= 0.01 * measured_over
