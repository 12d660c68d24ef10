"""Op-level selective checkpointing as data, checked against policies written here directly on
torch's ``create_selective_checkpoint_contexts``: torchtitan's op SAC and NeMo's keep-the-router
mode rerun the same ops, the same FLOPs, and keep the same bytes."""

from __future__ import annotations

import warnings
from collections import Counter, defaultdict

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import ac_policies
from tests.support.batches import loss_and_grads, token_batch
from tests.support.tiny_models import tiny_ac_model
from ac_policies.measure import kept_for_backward, recompute_flops
from ac_policies.selective import SelectiveOps, make_policy, resolve_ops

aten = torch.ops.aten


class _Reruns(TorchDispatchMode):
    """Counts the ops that actually run with grad mode on during backward (the recompute)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if torch.is_grad_enabled():
            self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def reruns(model, ids) -> Counter:
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    mode = _Reruns()
    with mode:
        loss.backward()
    return mode.ops


# torchtitan's op SAC, written from its documented behaviour: save mm, SDPA kernels, max,
# reduce_scatter, all_to_all and flex attention; recompute every second mm of a region; always
# recompute (and do not count) the router gate's mm, found by the weight's transposed shape.
def _titan_context_fn(router_shapes: set):
    save = {
        aten.mm.default, aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_cudnn_attention.default,
        aten._scaled_dot_product_attention_math.default, aten._scaled_dot_product_fused_attention_overrideable.default,
        torch.ops._c10d_functional.reduce_scatter_tensor.default, torch.ops._c10d_functional.all_to_all_single.default,
        aten.max.default, torch.ops.higher_order.flex_attention,
    }

    def context_fn():
        meta = defaultdict(int)

        def policy(ctx, func, *args, **kwargs):
            key = "recompute" if ctx.is_recompute else "forward"
            if func == aten.mm.default:
                if tuple(args[1].shape) in router_shapes:
                    return CheckpointPolicy.PREFER_RECOMPUTE
                meta[key] += 1
            keep = func in save and not (func == aten.mm.default and meta[key] % 2 == 0)
            return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

        return create_selective_checkpoint_contexts(policy)

    return context_fn


def _keep_router_context_fn(router_shapes: set):
    def policy(ctx, func, *args, **kwargs):
        if func in (aten.mm.default,) and tuple(args[1].shape) in router_shapes:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.MUST_SAVE if func.overloadpacket is aten.topk else CheckpointPolicy.PREFER_RECOMPUTE

    return lambda: create_selective_checkpoint_contexts(policy)


def _by_hand(model, context_fn):
    """Wrap every decoder layer directly with torch's checkpoint; returns an undo function."""
    layers = list(model.model.layers)
    for layer in layers:
        orig = layer.forward

        def forward(*args, _orig=orig, **kwargs):
            return checkpoint(lambda *a: _orig(*a, **kwargs), *args, use_reentrant=False, context_fn=context_fn)

        layer.forward = forward
    return lambda: [layer.__dict__.pop("forward") for layer in layers]


def _measure(model, ids):
    counts = reruns(model, ids)
    flops = recompute_flops(model, lambda: model(input_ids=ids, labels=ids).loss, ["model.layers.0.mlp.gate"])
    loss, kept = kept_for_backward(model, lambda: model(input_ids=ids, labels=ids).loss)
    loss.backward()
    return counts, flops, kept.live


@pytest.mark.filterwarnings("ignore::ac_policies.ACPolicyWarning")
@pytest.mark.parametrize("preset, reference", [("op_sac", _titan_context_fn), ("keep_router", _keep_router_context_fn)])
def test_presets_rerun_the_same_ops_flops_and_bytes_as_the_reference(preset, reference):
    model = tiny_ac_model("qwen3_moe", use_cache=False)
    ids = token_batch()
    loss0, grads0 = loss_and_grads(model, ids)
    gate = model.model.layers[0].mlp.gate.weight
    undo = _by_hand(model, reference({tuple(gate.t().shape)}))
    try:
        want = _measure(model, ids)
    finally:
        undo()
    with ac_policies.apply_policy(model, preset):
        got = _measure(model, ids)
        loss1, grads1 = loss_and_grads(model, ids)
    assert got[0] == want[0]  # op for op
    assert got[1] == want[1] and got[2] == want[2]  # recompute FLOPs (all, router), kept bytes
    assert got[0]["aten.mm.default"] > 0  # the comparison can fail: some matmuls are rerun
    if preset == "op_sac":
        assert got[1][1] > 0  # the router's matmul is always recomputed
    else:
        assert got[1][1] == 0 and got[0]["aten.topk.default"] == 0  # router output and routing kept
    torch.testing.assert_close(loss1, loss0, rtol=0, atol=0)
    for name in grads0:
        torch.testing.assert_close(grads1[name], grads0[name], rtol=1e-6, atol=1e-7)


@pytest.mark.filterwarnings("ignore::ac_policies.ACPolicyWarning")
def test_default_save_list_keeps_topk_so_routing_is_not_rerun():
    model = tiny_ac_model("qwen3_moe", use_cache=False)
    ids = token_batch()
    with ac_policies.apply_policy(model, "selective"):
        counts = reruns(model, ids)
    assert "topk" in ac_policies.DEFAULT_SAVE_OPS and counts["aten.topk.default"] == 0
    with ac_policies.apply_policy(model, [{"when": "decoder_block", "action": "selective", "ops": ["mm"]}]):
        assert reruns(model, ids)["aten.topk.default"] == 2  # without it, each layer reruns its routing


class _Chain(torch.nn.Module):
    def __init__(self, n: int = 6) -> None:
        super().__init__()
        self.block = torch.nn.Sequential(*[torch.nn.Linear(8, 8, bias=False) for _ in range(n)])

    def forward(self, x):
        return self.block(x).square()  # needs the last matmul output in backward


@pytest.mark.parametrize("k, rerun", [(1, 6), (2, 3), (3, 2), (4, 1), (7, 0)])
def test_recompute_every_kth_call(k, rerun):
    model = torch.nn.Sequential(_Chain())  # the region holds six matmuls and the square
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(0))
    rule = {"match": "0", "action": "selective", "ops": ["mm"], "recompute_every": {"k": k, "ops": ["mm"]}}
    with ac_policies.apply_policy(model, [rule]):
        y = model(x).sum()
        mode = _Reruns()
        with mode:
            y.backward()
    assert mode.ops["aten.mm.default"] == rerun  # calls k, 2k, ... of the six


def test_matmul_globs_resolve_to_weights_at_plan_time():
    model = _Chain()
    table = [{"match": "block", "action": "selective", "save_matmuls_of": ["block.0", "block.[12]"]}]
    row = ac_policies.plan(model, table)[0]
    assert row.selective.save_shapes == {(8, 8)}
    with pytest.warns(ac_policies.ACPolicyWarning, match="matched no module"):
        ac_policies.plan(model, [{"match": "block", "action": "selective", "recompute_matmuls_of": ["*.gate"]}])
    with pytest.raises(ValueError, match="holds no 2-D weight"):  # a glob whose modules hold no weight at all
        ac_policies.plan(torch.nn.Sequential(torch.nn.ReLU()), [{"action": "selective", "save_matmuls_of": ["0"]}])


class _Ctx:
    def __init__(self, is_recompute: bool) -> None:
        self.is_recompute = is_recompute


def test_save_lists_take_any_op_a_policy_sees():
    """Functional collectives and higher-order ops resolve and are saved; exact overloads stay exact."""
    names = ("_c10d_functional.all_to_all_single", "higher_order.flex_attention", "aten.max.default")
    found = resolve_ops(names)
    assert torch.ops._c10d_functional.all_to_all_single in found and torch.ops.higher_order.flex_attention in found
    policy = make_policy(SelectiveOps(save=names))
    save, recompute = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE
    assert policy(_Ctx(False), torch.ops.higher_order.flex_attention) is save
    assert policy(_Ctx(False), torch.ops._c10d_functional.all_to_all_single.default) is save
    assert policy(_Ctx(False), aten.max.default) is save
    assert policy(_Ctx(False), aten.max.dim) is recompute  # another overload of max
    assert policy(_Ctx(False), aten.mm.default) is recompute


def test_layers_takes_a_step():
    p = ac_policies.layers(1, None, 2)
    assert [i for i in range(7) if p(f"model.layers.{i}", torch.nn.Identity())] == [1, 3, 5]
    assert ac_policies.Rule.from_dict(ac_policies.Rule(when=p).to_dict()).when == p
    with pytest.raises(ValueError, match="step"):
        ac_policies.layers(0, None, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fqns = [r.fqn for r in ac_policies.plan(tiny_ac_model("llama", num_hidden_layers=4), [{"when": {"layers": [0, None, 2]}, "match": "model.layers.?"}])]
    assert fqns == ["model.layers.0", "model.layers.2"]


def test_step_bytes_counts_kept_and_peak_activations():
    """A chain of L bias-free linears then a square: forward keeps the L matmul outputs (n x d
    fp32 each) and peaks at L + 1 of them; checkpointing the chain keeps none of them."""
    from ac_policies.measure import step_bytes

    n, d, layers = 16, 8, 5
    model = torch.nn.Sequential(_Chain(layers))
    x = torch.randn(n, d, generator=torch.Generator().manual_seed(0))
    none = step_bytes(model, lambda: model(x).sum())
    one = n * d * 4
    assert none.kept == layers * one
    loss, kept = kept_for_backward(model, lambda: model(x).sum())  # the other counter agrees
    assert kept.live == none.kept
    assert none.peak >= (layers + 1) * one
    with ac_policies.apply_policy(model, [{"match": "0", "action": "checkpoint"}]):
        ckpt = step_bytes(model, lambda: model(x).sum())
    assert ckpt.kept == 0  # only the region's input, made before the step, is held
    assert (layers + 1) * one <= ckpt.peak  # the recompute rebuilds the chain in backward
