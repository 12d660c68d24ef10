"""Rules, predicates, tables, presets and plans, on small hand-built modules (no transformers)."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

import ac_policies
from ac_policies import Policy, Rule, all_of, any_of, inside, layers, not_


class Attn(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(d, d) for _ in range(4))
        self.q_norm = nn.RMSNorm(d)

    def forward(self, x):
        return self.o_proj(torch.softmax(self.q_norm(self.q_proj(x)) @ self.k_proj(x).transpose(-1, -2), -1) @ self.v_proj(x))


class MLP(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(d, 16), nn.Linear(d, 16), nn.Linear(16, d)

    def forward(self, x):
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class MoE(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.gate = nn.Linear(d, 2)
        self.experts = nn.ModuleList([MLP(d), MLP(d)])

    def forward(self, x):
        w = torch.softmax(self.gate(x), -1)
        return sum(w[..., i : i + 1] * e(x) for i, e in enumerate(self.experts))


class Block(nn.Module):
    def __init__(self, moe: bool) -> None:
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = nn.RMSNorm(8), nn.LayerNorm(8)
        self.self_attn = Attn()
        self.mlp = MoE() if moe else MLP()

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Toy(nn.Module):
    def __init__(self, moe_layers=(1,)) -> None:
        super().__init__()
        self.embedding_layer = nn.Linear(4, 8)
        self.layers = nn.ModuleList([Block(i in moe_layers) for i in range(3)])
        self.norm = nn.RMSNorm(8)

    def forward(self, x):
        h = self.embedding_layer(x)
        for layer in self.layers:
            h = layer(h)
        return self.norm(h)


def fqns(plan, action=None):
    return [r.fqn for r in plan if action is None or r.action == action]


def test_import_does_not_import_transformers():
    code = "import sys, ac_policies, ac_policies.measure; assert 'transformers' not in sys.modules, 'imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(
    "glob, name, hit",
    [
        ("embed*", "embedding_layer", True),
        ("embed", "embedding_layer", False),  # whole name, never a substring
        ("layers.*.mlp", "layers.1.mlp", True),
        ("layers.*.mlp", "layers.1.mlp.gate", False),
        ("layers.*.mlp", "layers.1.mlp_norm", False),
        ("layers.*.mlp*", "layers.1.mlp.gate", True),  # `*` crosses dots
        ("layers.?.mlp", "layers.12.mlp", False),
        ("Layers.*", "layers.0", False),  # case-sensitive
        ("layers.[02].self_attn", "layers.2.self_attn", True),
    ],
)
def test_globs_match_whole_names(glob, name, hit):
    assert Rule(match=glob).matches(name, nn.Identity()) is hit


def test_structural_predicates_on_toy_model():
    m = Toy()
    def names(kind):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return fqns(ac_policies.plan(m, [Rule(when=kind, action="none")]))
    assert names("moe") == ["layers.1.mlp"]
    assert names("attention") == [f"layers.{i}.self_attn" for i in range(3)]
    assert names("dense_mlp") == ["layers.0.mlp", "layers.1.mlp.experts.0", "layers.1.mlp.experts.1", "layers.2.mlp"]
    assert names("decoder_block") == ["layers.0", "layers.1", "layers.2"]
    assert "layers.0.self_attn.q_norm" in names("norm") and "layers.0.post_attention_layernorm" in names("norm")
    assert names(layers(1, 2))[0] == "layers.1"
    assert all(n.startswith("layers.1") for n in names(layers(1, 2)))
    assert names(all_of("norm", not_(inside("attention")))) == [
        f"layers.{i}.{n}" for i in range(3) for n in ("input_layernorm", "post_attention_layernorm")
    ] + ["norm"]


def test_first_match_wins_and_none_stops_later_rules():
    m = Toy()
    table = [Rule(match="layers.1.*", action="none"), Rule(when="attention", action="checkpoint")]
    p = ac_policies.plan(m, table)
    assert fqns(p, "checkpoint") == ["layers.0.self_attn", "layers.2.self_attn"]
    assert "layers.1.self_attn" in fqns(p, "none")


def test_combinators_and_operators_print_readably():
    moe = ac_policies.resolve_policy("non_moe").rules[0].when
    assert str(moe) == "moe | inside(moe)"
    p = ac_policies.predicate(lambda f, m: True, name="always")
    assert str(Rule(match="layers.*", when=p & ~layers(0, 1))) == "match('layers.*') & always & ~layers(0, 1) -> checkpoint"
    assert str(any_of("norm", "moe") & "attention") == "(norm | moe) & attention"
    with pytest.raises(ValueError, match="at least one"):
        all_of()


def test_table_round_trips_through_dicts_and_json():
    table = Policy(
        (
            Rule(match="layers.*.mlp", when="moe", action="none", on_unmatched="error"),
            Rule(when=all_of("norm", not_(inside(any_of("attention", "linear_attention")))), action="checkpoint"),
            Rule(when={"layers": [0, 2]}, action="selective", ops=("mm", "bmm")),
            Rule(match="lm_head", action="offload", on_unmatched="ignore"),
        ),
        name="mine",
    )
    data = table.to_dicts()
    assert json.loads(json.dumps(data)) == data  # plain data
    assert Policy.from_dicts(data, name="mine") == table
    assert Policy.from_json(table.to_json(), name="mine") == table
    for preset in ac_policies.PRESETS.values():
        assert Policy.from_dicts(preset.to_dicts(), name=preset.name) == preset


def test_python_predicates_need_a_registered_name_to_serialise():
    def is_embedding(fqn, module):
        return fqn.startswith("embedding")

    rule = Rule(when=is_embedding, action="checkpoint")
    with pytest.raises(TypeError, match="register_predicate"):
        rule.to_dict()
    registered = ac_policies.register_predicate("toy_is_embedding", is_embedding)
    assert Rule(when=is_embedding).to_dict()["when"] == "toy_is_embedding"
    assert Rule.from_dict({"when": "toy_is_embedding"}).when is registered
    with pytest.raises(ValueError, match="already registered"):
        ac_policies.register_predicate("moe", is_embedding)


@pytest.mark.parametrize(
    "bad, error, text",
    [
        (dict(action="recompute"), ValueError, "checkpoint"),
        (dict(match=""), TypeError, "glob"),
        (dict(when="mixture"), ValueError, "unknown predicate 'mixture'"),
        (dict(when={"layers": [3, 1]}), ValueError, "start < stop"),
        (dict(action="checkpoint", ops=["mm"]), ValueError, "selective"),
        (dict(action="selective", ops=["not_an_op"]), ValueError, "unknown ops"),
        (dict(action="selective", ops=["aten.mm.nope"]), ValueError, "unknown ops"),
        (dict(action="selective", ops=["a.b.c.d"]), ValueError, "higher_order.flex_attention"),
        (dict(action="selective", recompute_every={"k": 0}), ValueError, "positive int"),
        (dict(action="selective", recompute_every=2), TypeError, "'k': 2"),
        (dict(action="checkpoint", recompute_matmuls_of=["*.gate"]), ValueError, "selective"),
        (dict(action="selective", save_matmuls_of="*.gate"), TypeError, "list of module globs"),
        (dict(action="selective", ops=["aten.mm.nope?", "aten.bmm.nope"]), ValueError, r"unknown ops \['aten.bmm.nope'\]"),
        (dict(action="selective", save_copies_to_cpu_from="cuda"), TypeError, "device types"),
        (dict(action="selective", save_copies_to_cpu_from=["cpu"]), ValueError, "destination"),
        (dict(action="checkpoint", save_copies_to_cpu_from=["cuda"]), ValueError, "selective"),
        (dict(on_unmatched="maybe"), ValueError, "on_unmatched"),
    ],
)
def test_bad_rules_say_what_was_wrong(bad, error, text):
    with pytest.raises(error, match=text):
        Rule(**bad)
    with pytest.raises(ValueError, match="unknown rule keys"):
        Rule.from_dict({"match": "*", "actoin": "none"})


@pytest.mark.parametrize("name", ["NON-MOE", "non_moe", " Non Moe ", "non-MoE"])
def test_preset_names_are_normalised(name):
    assert ac_policies.resolve_policy(name) is ac_policies.PRESETS["non_moe"]


def test_booleans_and_unknown_names():
    assert ac_policies.resolve_policy(True) is ac_policies.PRESETS["full"]
    assert ac_policies.resolve_policy(False) is ac_policies.PRESETS["none"]
    with pytest.raises(ValueError, match=r"valid presets: \['full', 'keep_router', 'long_context', 'non_moe', 'non_moe_no_attn', 'none', 'op_sac', 'selective'\]"):
        ac_policies.resolve_policy("no-moe")
    with pytest.raises(TypeError, match="preset name"):
        ac_policies.resolve_policy(3)


def test_moe_presets_refuse_a_dense_model():
    with pytest.raises(ValueError, match="needs a MoE block"):
        ac_policies.plan(Toy(moe_layers=()), "non_moe")
    with pytest.raises(ValueError, match="needs a MoE block"):
        ac_policies.apply_policy(Toy(moe_layers=()), "non-moe-no-attn")


@pytest.mark.filterwarnings("ignore:.*lie in a checkpointed region")
def test_plan_warns_or_rejects_unmatched_rules_and_nesting():
    m = Toy()
    table = [Rule(when="decoder_block"), Rule(match="nothing.here")]
    with pytest.warns(ac_policies.ACPolicyWarning) as record:
        p = ac_policies.plan(m, table)
    text = " ".join(str(w.message) for w in record)
    assert "rule 1" in text and "matched no module" in text
    assert p.unmatched == (1,)
    nested = [Rule(when="decoder_block"), Rule(match="*self_attn")]
    with pytest.warns(ac_policies.ACPolicyWarning, match="nested"):
        p = ac_policies.plan(m, nested)
    assert ("layers.0", "layers.0.self_attn") in p.nested
    with pytest.raises(ValueError, match="strict plan rejected.*nested"):
        ac_policies.plan(m, nested, strict=True)
    with pytest.raises(ValueError, match="strict plan rejected.*matched no module"):
        ac_policies.apply_policy(m, table, strict=True)
    assert not any("forward" in mod.__dict__ for mod in m.modules())


def test_plan_does_not_touch_the_model_and_prints_a_table():
    m = Toy()
    before = {n: dict(mod.__dict__) for n, mod in m.named_modules()}
    p = ac_policies.plan(m, "non_moe")
    assert {n: dict(mod.__dict__) for n, mod in m.named_modules()} == before
    assert all(isinstance(r, ac_policies.PlanRow) for r in p)
    with pytest.raises(Exception):
        p[0].action = "none"  # frozen rows
    text = str(p).splitlines()
    assert text[0].startswith("plan of non_moe on Toy: 12 module(s) wrapped")
    assert text[1].split() == ["module", "type", "action", "rule"]
    assert len({line.index("checkpoint") for line in text[3:] if " checkpoint " in line}) == 1  # aligned


@pytest.mark.filterwarnings("ignore::ac_policies.ACPolicyWarning")
def test_toy_model_parity_for_every_action():
    torch.manual_seed(0)
    m = Toy()
    x = torch.randn(2, 5, 4)
    m(x).square().sum().backward()
    ref = {n: p.grad.clone() for n, p in m.named_parameters()}
    for action in ("checkpoint", "selective", "offload"):
        m.zero_grad()
        with ac_policies.apply_policy(m, [Rule(when="decoder_block", action=action)]):
            m(x).square().sum().backward()
        for n, p in m.named_parameters():
            torch.testing.assert_close(p.grad, ref[n], rtol=1e-6, atol=1e-7)


def test_undo_refuses_when_forward_was_replaced_later():
    m = Toy()
    handle = ac_policies.apply_policy(m, [Rule(when="attention")])
    m.layers[0].self_attn.forward = lambda x: x
    with pytest.raises(ValueError, match="cannot be unwrapped"):
        handle.remove()
    del m.layers[0].self_attn.forward
    with pytest.raises(ValueError, match="cannot be unwrapped"):
        handle.remove()
    assert handle.active


def test_undo_takes_the_policy_out_from_under_a_later_wrapper():
    # the behaviour every handle shares (patch_layer.Handle): a later wrapper that holds the policy's
    # forward in a closure stays installed and calls the module's own forward once the policy is removed
    torch.manual_seed(0)
    m = Toy()
    x = torch.randn(2, 5, 4)
    attn = m.layers[0].self_attn
    handle = ac_policies.apply_policy(m, [Rule(when="attention")])
    policy_forward = attn.forward
    calls = []

    def later(*args, **kwargs):
        calls.append(1)
        return policy_forward(*args, **kwargs)

    attn.forward = later
    handle.remove()
    assert not handle.active and ac_policies.policy_of(m) is None
    assert attn.__dict__["forward"] is later  # the later code stays
    m.train()
    m(x).sum().backward()
    assert calls == [1]
