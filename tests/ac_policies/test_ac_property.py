"""Hypothesis: for random tables over a real tiny model (selective rules with random save lists,
every-k-th recompute and matmul globs included), plan then apply wraps exactly the planned
modules, first match wins, gradients never change, tables survive JSON, and undo leaves
nothing behind."""

from __future__ import annotations

import fnmatch
import json
import warnings

import torch
from hypothesis import given
from hypothesis import strategies as st

import ac_policies
from ac_policies import Policy, Rule, inside, layers, not_
from ac_policies.structure import planning
from tests.support.batches import loss_and_grads, token_batch
from tests.support.tiny_models import tiny_ac_model

MODEL = tiny_ac_model("qwen3_next")  # MoE with shared experts, linear and full attention
IDS = token_batch(s=8)
LOSS0, GRADS0 = loss_and_grads(MODEL, IDS)

GLOBS = ["*", "model.layers.*", "model.layers.0*", "*.mlp", "*.mlp.*", "*attn", "*norm*", "*_proj",
         "model.layers.1.self_attn", "lm_head", "*.experts", "model.layers.?"]
PREDICATES = [None, "moe", "attention", "linear_attention", "norm", "dense_mlp", "decoder_block",
              layers(0, 1), layers(1, None), inside("moe"), not_("moe")]
PREDICATES += [layers(0, None, 2), layers(1, None, 3)]
# save lists with any op kind: aten packets and overloads, a functional collective, a higher-order op
OPS = ["mm", "addmm", "bmm", "topk", "aten.mm.default", "aten.max.default", "_c10d_functional.all_to_all_single",
       "higher_order.flex_attention", "_scaled_dot_product_flash_attention_for_cpu"]
MATMUL_GLOBS = [("*.mlp.gate",), ("*.q_proj", "*.o_proj"), ("*.shared_expert.*",), ("*.in_proj_qkvz",)]
plain_rules = st.builds(
    Rule,
    match=st.sampled_from(GLOBS),
    when=st.sampled_from(PREDICATES),
    action=st.sampled_from(["checkpoint", "selective", "offload", "none"]),
    on_unmatched=st.just("ignore"),
)
selective_rules = st.builds(
    Rule,
    match=st.sampled_from(GLOBS),
    when=st.sampled_from(PREDICATES),
    action=st.just("selective"),
    ops=st.one_of(st.none(), st.lists(st.sampled_from(OPS), min_size=1, max_size=4, unique=True).map(tuple)),
    recompute_every=st.one_of(st.none(), st.fixed_dictionaries(
        {"k": st.integers(1, 3), "ops": st.sampled_from([["mm"], ["aten.mm.default", "addmm"], ["topk"]])})),
    recompute_matmuls_of=st.one_of(st.none(), st.sampled_from(MATMUL_GLOBS)),
    save_matmuls_of=st.one_of(st.none(), st.sampled_from(MATMUL_GLOBS)),
    on_unmatched=st.just("ignore"),
)
rules = st.one_of(plain_rules, selective_rules)


def first_match_oracle(table: list[Rule]) -> dict[str, str]:
    """fqn -> action by the table's definition, written independently of Policy.first_match."""
    out = {}
    with planning(MODEL):
        for fqn, module in MODEL.named_modules():
            for rule in table:
                if fnmatch.fnmatchcase(fqn, rule.match) and (rule.when is None or rule.when(fqn, module)):
                    out[fqn] = rule.action
                    break
    return out


@given(table=st.lists(rules, min_size=1, max_size=4))
def test_random_tables_apply_exactly_their_plan(table):
    data = Policy(tuple(table)).to_dicts()
    assert Policy.from_json(json.dumps(data)) == Policy(tuple(table))  # plain data, JSON included
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ac_policies.ACPolicyWarning)
        p = ac_policies.plan(MODEL, table)
        assert {r.fqn: r.action for r in p} == first_match_oracle(table)
        handle = ac_policies.apply_policy(MODEL, table)
    try:
        patched = {n for n, m in MODEL.named_modules() if "forward" in m.__dict__}
        assert patched == {r.fqn for r in p.wrapped}
        loss, grads = loss_and_grads(MODEL, IDS)
    finally:
        handle.remove()
    assert not any("forward" in m.__dict__ for m in MODEL.modules())
    torch.testing.assert_close(loss, LOSS0, rtol=0, atol=0)
    assert grads.keys() == GRADS0.keys()
    for name, g in grads.items():
        torch.testing.assert_close(g, GRADS0[name], rtol=1e-6, atol=1e-7, msg=lambda m: f"{name}: {m}")
