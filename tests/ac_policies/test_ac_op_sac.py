"""Op-level selective checkpointing as data, checked against policies written here directly on
torch's ``create_selective_checkpoint_contexts``: torchtitan's op SAC (as in
torchtitan/distributed/activation_checkpoint.py, ``SelectiveAC``) and NeMo's keep-the-router
mode rerun the same ops, the same FLOPs, keep the same bytes and give the same gradients."""

from __future__ import annotations

import warnings
from collections import Counter, defaultdict

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import ac_policies
from ac_policies.measure import kept_for_backward, recompute_flops
from ac_policies.presets import TORCHTITAN_SAVE_OPS
from ac_policies.selective import SelectiveOps, make_policy, resolve_ops
from tests.support.batches import loss_and_grads, token_batch
from tests.support.tiny_models import tiny_ac_model

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


def _titan_save_ops() -> set:
    """torchtitan's op-SAC save set, assembled as torchtitan assembles it
    (torchtitan/distributed/activation_checkpoint.py, ``SelectiveAC``): torch's compute-intensive
    ops, its own list, and the ops of optional extensions where they are registered."""
    from torch._functorch.partitioners import get_default_op_list

    save = {op.default for op in get_default_op_list().compute_intensive_ops}
    save |= {
        aten._scaled_dot_product_cudnn_attention.default, aten._scaled_dot_product_attention_math.default,
        aten._scaled_dot_product_fused_attention_overrideable.default, aten.max.default,
        torch._higher_order_ops.flex_attention, aten.linear.default, aten.topk.default,
        torch.ops._c10d_functional.reduce_scatter_tensor.default, torch.ops._c10d_functional.all_to_all_single.default,
    }
    optional = [(torch._higher_order_ops, "inductor_compiled_code"), (torch.ops, "torch_attn._varlen_attn.default")]
    optional += [(torch.ops, f"{lib}.{op}.default") for lib in ("deepep", "hybridep") for op in ("dispatch", "combine")]
    for obj, path in optional:
        try:
            for part in path.split("."):
                obj = getattr(obj, part)
        except AttributeError:
            continue
        save.add(obj)
    return save


def _titan_router_shapes(block: torch.nn.Module, router: str = "mlp.gate") -> set:
    """The ``(in, out)`` shapes of the block's router weights, found by module name as torchtitan
    finds ``moe.router.gate`` (here the Transformers name of Qwen3-MoE's router)."""
    return {(m.weight.shape[1], m.weight.shape[0]) for name, m in block.named_modules() if router in name}


def _titan_policy(save: set, router_shapes: set):
    """torchtitan's op-SAC policy for one region call: device-to-host copies saved; every ``mm`` /
    ``linear`` counted (forward and recompute apart) unless its weight is the router's, which is
    always recomputed; the save set kept except every second counted matmul."""
    meta = defaultdict(int)
    matmuls = (aten.mm.default, aten.linear.default)

    def policy(ctx, func, *args, **kwargs):
        if (func == aten._to_copy.default and "cuda" in str(args[0].device)
                and "device" in kwargs and str(kwargs["device"]) == "cpu"):
            return CheckpointPolicy.MUST_SAVE
        key = "recompute" if ctx.is_recompute else "forward"
        if func in matmuls:
            shape = tuple(args[1].shape)
            if (shape[::-1] if func == aten.linear.default else shape) in router_shapes:
                return CheckpointPolicy.PREFER_RECOMPUTE
            meta[key] += 1
        if func in save:
            if func in matmuls and meta[key] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _titan_context_fn(block: torch.nn.Module):
    save, routers = _titan_save_ops(), _titan_router_shapes(block)
    return lambda: create_selective_checkpoint_contexts(_titan_policy(save, routers))


def _keep_router_context_fn(block: torch.nn.Module):
    router_shapes = {tuple(block.mlp.gate.weight.t().shape)}

    def policy(ctx, func, *args, **kwargs):
        if func in (aten.mm.default,) and tuple(args[1].shape) in router_shapes:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.MUST_SAVE if func.overloadpacket is aten.topk else CheckpointPolicy.PREFER_RECOMPUTE

    return lambda: create_selective_checkpoint_contexts(policy)


def _by_hand(model, context_fn_of):
    """Wrap every decoder layer directly with torch's checkpoint, with ``context_fn_of(layer)``."""
    for layer in model.model.layers:
        orig, context_fn = layer.forward, context_fn_of(layer)

        def forward(*args, _orig=orig, _context_fn=context_fn, **kwargs):
            return checkpoint(lambda *a: _orig(*a, **kwargs), *args, use_reentrant=False, context_fn=_context_fn)

        layer.forward = forward


def _measure(model, ids):
    counts = reruns(model, ids)
    flops = recompute_flops(model, lambda: model(input_ids=ids, labels=ids).loss, ["model.layers.0.mlp.gate"])
    loss, kept = kept_for_backward(model, lambda: model(input_ids=ids, labels=ids).loss)
    loss.backward()
    return counts, flops, kept.live


@pytest.mark.filterwarnings("ignore::ac_policies.ACPolicyWarning")
@pytest.mark.parametrize("preset, reference", [("op_sac", _titan_context_fn), ("keep_router", _keep_router_context_fn)])
def test_presets_rerun_the_same_ops_flops_and_bytes_as_the_reference(preset, reference):
    """The reference policy wraps each block of one model; the preset is applied to an identical copy."""
    ids = token_batch()
    by_hand, model = tiny_ac_model("qwen3_moe", use_cache=False), tiny_ac_model("qwen3_moe", use_cache=False)
    loss0, grads0 = loss_and_grads(model, ids)
    _by_hand(by_hand, reference)
    want = _measure(by_hand, ids)
    loss_want, grads_want = loss_and_grads(by_hand, ids)
    with ac_policies.apply_policy(model, preset):
        got = _measure(model, ids)
        loss1, grads1 = loss_and_grads(model, ids)
    assert got[0] == want[0]  # op for op: the same ops rerun, as often
    assert got[1] == want[1] and got[2] == want[2]  # recompute FLOPs (all, router), kept bytes
    assert got[0]["aten.mm.default"] > 0  # the comparison can fail: some matmuls are rerun
    assert got[0]["aten.topk.default"] == 0  # both presets keep the routing decision
    if preset == "op_sac":
        assert got[1][1] > 0  # the router's matmul is always recomputed
    else:
        assert got[1][1] == 0  # the router output is kept
    torch.testing.assert_close(loss1, loss_want, rtol=0, atol=0)
    assert grads1.keys() == grads_want.keys()
    for name in grads_want:
        torch.testing.assert_close(grads1[name], grads_want[name], rtol=0, atol=0)  # bitwise
    torch.testing.assert_close(loss1, loss0, rtol=0, atol=0)
    for name in grads0:
        torch.testing.assert_close(grads1[name], grads0[name], rtol=1e-6, atol=1e-7)


def test_op_sac_saves_torchtitans_ops():
    assert resolve_ops(TORCHTITAN_SAVE_OPS) == _titan_save_ops()
    assert "aten.topk.default" in TORCHTITAN_SAVE_OPS


class _OnDevice:
    """Stands in for a tensor on ``device`` where a policy only reads the device."""

    def __init__(self, device: str) -> None:
        self.device = torch.device(device)


@pytest.mark.filterwarnings("ignore::ac_policies.ACPolicyWarning")
def test_op_sac_decides_as_torchtitan_call_for_call():
    """Calls eager CPU runs never make (``linear`` left whole, copies from CUDA to the CPU) fed to
    the preset's policy and torchtitan's: the same choice for each, forward then recompute."""
    model = tiny_ac_model("qwen3_moe", use_cache=False)
    block = model.model.layers[0]
    spec = ac_policies.plan(model, "op_sac")[0].selective
    d = model.config.hidden_size
    x, w, router = torch.empty(3, d, device="meta"), torch.empty(d, d, device="meta"), block.mlp.gate.weight
    calls = [
        (aten.mm.default, (x, w), {}), (aten.mm.default, (x, router.t()), {}), (aten.linear.default, (x, w), {}),
        (aten.linear.default, (x, router), {}), (aten.mm.default, (x, w), {}), (aten.topk.default, (x, 2), {}),
        (aten._to_copy.default, (_OnDevice("cuda"),), {"device": torch.device("cpu")}),
        (aten._to_copy.default, (_OnDevice("cuda"),), {"device": "cpu"}),
        (aten._to_copy.default, (_OnDevice("cpu"),), {"device": "cpu"}),
        (aten._to_copy.default, (_OnDevice("cuda"),), {"dtype": torch.float16}),
        (aten.bmm.default, (x[None], w[None]), {}), (aten.addmm.default, (x[0], x, w), {}),
        (aten.max.default, (x,), {}), (aten.max.dim, (x, 0), {}), (aten.silu.default, (x,), {}),
        (torch.ops.higher_order.flex_attention, (), {}), (torch.ops._c10d_functional.all_to_all_single.default, (), {}),
        (aten.linear.default, (x, w), {}), (aten.mm.default, (x, w), {}),
    ]
    ours, titan = make_policy(spec), _titan_policy(_titan_save_ops(), _titan_router_shapes(block))
    for phase in (False, True):
        got = [ours(_Ctx(phase), op, *args, **kw) for op, args, kw in calls]
        want = [titan(_Ctx(phase), op, *args, **kw) for op, args, kw in calls]
        assert got == want
    assert got[1] == got[3] == CheckpointPolicy.PREFER_RECOMPUTE and got[6] == CheckpointPolicy.MUST_SAVE
    # the one generalisation: a router with a bias (addmm) is recomputed, where torchtitan saves it
    assert ours(_Ctx(False), aten.addmm.default, x[0], x, router.t()) == CheckpointPolicy.PREFER_RECOMPUTE
    assert titan(_Ctx(False), aten.addmm.default, x[0], x, router.t()) == CheckpointPolicy.MUST_SAVE


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
