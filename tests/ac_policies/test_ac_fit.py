"""``ac_policies.fit``: the budget is met, with no more recompute than any table giving each block
one action; recompute never grows with the budget; budget 1.0 recomputes nothing; gradients are
unchanged; the model is left as it was found; bad inputs are clear errors."""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ac_policies
from ac_policies.fit import parse_budget
from ac_policies.fit_search import Choice, Option, select
from ac_policies.fit_search import candidates as ranked_candidates
from ac_policies.measure import StepCost, step_cost
from tests.support.batches import loss_and_grads, token_batch
from tests.support.tiny_models import tiny_ac_model

MODEL = tiny_ac_model("llama", num_hidden_layers=3)
IDS = token_batch(s=32)


def step() -> torch.Tensor:
    return MODEL(input_ids=IDS, labels=IDS).loss


def measured(model: torch.nn.Module, run, policy) -> StepCost:
    """The step's peak and recompute under ``policy``, from fresh gradients and one RNG state."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ac_policies.ACPolicyWarning)
        handle = ac_policies.apply_policy(model, policy)
    try:
        model.zero_grad(set_to_none=True)
        torch.manual_seed(0)
        return step_cost(model, run)
    finally:
        handle.remove()
        model.zero_grad(set_to_none=True)


def cost(c: StepCost) -> tuple[int, int]:
    return c.recompute_flops, c.recompute_ops


NONE = measured(MODEL, step, "none")
PEAK0 = NONE.peak
FULL = measured(MODEL, step, "full")
#: every table that gives each decoder block one action, measured once
PER_BLOCK = {
    actions: measured(MODEL, step, [{"match": f"model.layers.{i}", "action": a} for i, a in enumerate(actions) if a != "none"])
    for actions in itertools.product(("none", "selective", "checkpoint"), repeat=3)
}


@pytest.mark.parametrize("fraction", [0.5, 0.7, 0.9])
def test_budget_met_with_no_more_recompute_than_any_per_block_table(fraction: float) -> None:
    policy = ac_policies.fit(MODEL, step, fraction)
    got = measured(MODEL, step, policy)
    limit = int(fraction * PEAK0)
    assert got.peak <= limit, (got.peak, limit, policy)
    feasible = [cost(c) for c in PER_BLOCK.values() if c.peak <= limit]
    assert feasible, "the grid of per-block tables should reach this budget"
    assert cost(got) <= min(feasible), (cost(got), min(feasible), policy)
    assert got.recompute_flops <= FULL.recompute_flops
    assert f"within {limit / 2**20:.2f} MiB" in policy.summary


def test_recompute_never_grows_with_the_budget_and_budget_one_recomputes_nothing() -> None:
    costs = []
    for fraction in (0.45, 0.6, 0.75, 0.9, 1.0):
        policy = ac_policies.fit(MODEL, step, fraction)
        got = measured(MODEL, step, policy)
        assert got.peak <= int(fraction * PEAK0)
        costs.append(cost(got))
    assert costs == sorted(costs, reverse=True), costs
    assert costs[-1] == cost(NONE)  # what backward runs with grad mode on anyway
    assert ac_policies.fit(MODEL, step, 1.0).rules == ()


def test_moe_model_within_budget_recomputing_less_than_full() -> None:
    model = tiny_ac_model("qwen3_moe")
    ids = token_batch(s=24)
    run = lambda: model(input_ids=ids, labels=ids).loss  # noqa: E731
    peak0 = measured(model, run, "none").peak
    policy = ac_policies.fit(model, run, 0.6)
    got = measured(model, run, policy)
    assert got.peak <= int(0.6 * peak0)
    assert got.recompute_flops <= measured(model, run, "full").recompute_flops
    shown = str(ac_policies.plan(model, policy))
    assert "measured (fit)" in shown and policy.summary in shown and "MFLOP" in shown


def test_gradients_are_bitwise_equal_under_the_fitted_table() -> None:
    policy = ac_policies.fit(MODEL, step, 0.5)
    assert policy.rules
    loss0, grads0 = loss_and_grads(MODEL, IDS)
    with ac_policies.apply_policy(MODEL, policy):
        loss1, grads1 = loss_and_grads(MODEL, IDS)
    assert torch.equal(loss0, loss1)
    assert grads0.keys() == grads1.keys() and all(torch.equal(grads0[k], grads1[k]) for k in grads0)
    MODEL.zero_grad(set_to_none=True)


def test_the_model_is_left_as_it_was_found() -> None:
    model = tiny_ac_model("llama", seed=3)
    ids = token_batch(s=16)
    params = list(model.parameters())
    given_grads = {0: torch.randn_like(params[0]), 3: torch.randn_like(params[3])}
    for i, g in given_grads.items():
        params[i].grad = g
    state = {k: v.clone() for k, v in model.state_dict().items()}
    names = [(n, type(m)) for n, m in model.named_modules()]
    rng = torch.get_rng_state()
    ac_policies.fit(model, lambda: model(input_ids=ids, labels=ids).loss, 0.6)
    assert [(n, type(m)) for n, m in model.named_modules()] == names
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert all((p.grad is given_grads[i]) if i in given_grads else p.grad is None for i, p in enumerate(params))
    assert all(torch.equal(params[i].grad, given_grads[i]) for i in given_grads)
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert not any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks for m in model.modules())
    assert torch.equal(torch.get_rng_state(), rng)


def test_the_fitted_table_is_ordinary_data() -> None:
    policy = ac_policies.fit(MODEL, step, 0.6)
    again = ac_policies.Policy.from_json(policy.to_json())
    assert again.rules == policy.rules and len(policy.estimates) == len(policy.rules)
    assert all(r.action in ("selective", "checkpoint") for r in policy.rules)


@pytest.mark.parametrize("budget", [0, -5, 0.0, 1.5, float("nan"), "lots", "12 parsecs", "-1GB", True, None])
def test_bad_budgets_are_clear_errors(budget) -> None:
    with pytest.raises(ValueError, match="budget"):
        ac_policies.fit(MODEL, step, budget)


def test_a_budget_below_the_smallest_reachable_peak_names_it() -> None:
    with pytest.raises(ValueError, match=r"smallest step peak the choices reach: [0-9.]+ MiB"):
        ac_policies.fit(MODEL, step, "1KiB")
    with pytest.raises(ValueError, match="smallest step peak"):
        ac_policies.fit(MODEL, step, 0.5, actions=("selective",))  # selective alone saves less


def test_bad_actions_and_models_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="unknown action 'recompute'"):
        ac_policies.fit(MODEL, step, 0.5, actions=("none", "recompute"))
    with pytest.raises(ValueError, match="at least one action"):
        ac_policies.fit(MODEL, step, 0.5, actions=("none",))
    MODEL.eval()
    try:
        with pytest.raises(ValueError, match="training mode"):
            ac_policies.fit(MODEL, step, 0.5)
    finally:
        MODEL.train()
    with ac_policies.apply_policy(MODEL, "full"):
        with pytest.raises(ValueError, match="without a policy applied"):
            ac_policies.fit(MODEL, step, 0.5)


def test_parse_budget_units() -> None:
    assert parse_budget("512MiB", 10) == 512 * 2**20
    assert parse_budget("8GB", 10) == 8 * 10**9
    assert parse_budget(" 1.5 gib ", 10) == int(1.5 * 2**30)
    assert parse_budget(4096, 10) == 4096
    assert parse_budget(0.25, 1000) == 250


# ---- the choice itself, on synthetic measurements ----------------------------------------------

options = st.lists(st.tuples(st.integers(1, 500), st.integers(0, 50), st.integers(0, 20)), min_size=1, max_size=3)


@settings(max_examples=60, deadline=None)
@given(per_block=st.lists(options, min_size=1, max_size=4), slack=st.lists(st.integers(0, 60), min_size=64, max_size=64),
       fractions=st.lists(st.floats(0.3, 1.0), min_size=2, max_size=4))
def test_select_meets_the_limit_and_cost_never_grows_with_it(per_block, slack, fractions) -> None:
    """Whatever the measured peaks (the prediction plus a transient the sum does not see), the
    choice is within the limit when one is, and a larger limit never costs more."""
    blocks = [f"model.layers.{i}" for i in range(len(per_block))]
    table = [[Option(Choice(((f"part{k}", "checkpoint"),)), saved, (flops, ops))
              for k, (saved, flops, ops) in enumerate(opts)] for opts in per_block]
    peak0 = 100 + sum(max(s for s, _, _ in opts) for opts in per_block)
    candidates = ranked_candidates(blocks, table, peak0)

    def peak_of(candidate) -> int:
        return peak0 - candidate.saved + slack[hash(candidate.rules) % len(slack)]

    chosen_costs = []
    for limit in sorted(int(f * peak0) for f in fractions):
        chosen, _ = select(candidates, peak0, limit, peak_of)
        if chosen is None:
            assert peak_of(candidates[-1]) > limit
            continue
        assert peak_of(chosen) <= limit
        chosen_costs.append(chosen.cost)
    assert chosen_costs == sorted(chosen_costs, reverse=True)
