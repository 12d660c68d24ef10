"""The ``offload`` action: activations to host memory on a side stream, prefetched back in backward.

On CPU: ``offload`` keeps activations where they are (gradients bit for bit those of no policy)
with one warning per process; the hooks' bookkeeping (what is offloaded, bitwise round trips,
prefetch order, regions freed with their graph) runs on CPU tensors through
``Offloader(device_type="cpu")`` and synchronous copies. CUDA tests (``-m cuda``, skipped without
a device): bitwise gradients, device memory after forward, prefetch with recorded events.
"""

from __future__ import annotations

import gc
import warnings

import pytest
import torch
from torch import nn

import ac_policies
import ac_policies.apply as ac_apply
from ac_policies.offload import CudaStreams, InlineStreams, Offloader, default_offloader
from tests.support.batches import loss_and_grads, token_batch
from tests.support.tiny_models import tiny_ac_model

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class Block(nn.Module):
    """[..., h] -> [..., h]: linear, GELU, linear, plus a registered scale buffer."""

    def __init__(self, h: int) -> None:
        super().__init__()
        self.up = nn.Linear(h, 2 * h)
        self.down = nn.Linear(2 * h, h)
        self.register_buffer("scale", torch.full((h,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x))) * self.scale


def _blocks(n: int = 3, h: int = 16, device: str = "cpu") -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(Block(h) for _ in range(n))).to(device)


def _run(model: nn.Sequential, x: torch.Tensor, off: Offloader | None = None, backwards: int = 1) -> dict[str, torch.Tensor]:
    """Forward through every block (each under its own region when ``off`` is given), ``backwards`` backward passes."""
    model.zero_grad(set_to_none=True)
    h = x
    for block in model:
        if off is None:
            h = block(h)
        else:
            with off.region(block).hooks():
                h = block(h)
    loss = h.square().sum()
    for i in range(backwards):
        loss.backward(retain_graph=i + 1 < backwards)
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _assert_bitwise(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    assert got.keys() == ref.keys()
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=0, atol=0, msg=f"gradient of {name} differs")


# ---- the action on CPU ------------------------------------------------------------------


def test_offload_on_cpu_keeps_activations_bitwise_and_warns_once(monkeypatch):
    monkeypatch.setattr(ac_apply, "_offload_warned", False)

    def no_hooks(*args, **kwargs):
        raise AssertionError("no offload region may be entered on CPU")

    monkeypatch.setattr(ac_apply, "default_offloader", no_hooks)
    model = tiny_ac_model("llama")
    ids = token_batch()
    loss0, grads0 = loss_and_grads(model, ids)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with ac_policies.apply_policy(model, [{"when": "decoder_block", "action": "offload"}]):
            loss1, grads1 = loss_and_grads(model, ids)
            loss2, grads2 = loss_and_grads(model, ids)
    ours = [w for w in seen if issubclass(w.category, ac_policies.ACPolicyWarning)]
    assert len(ours) == 1, [str(w.message) for w in ours]
    assert "nowhere to offload" in str(ours[0].message)
    torch.testing.assert_close(loss1, loss0, rtol=0, atol=0)
    torch.testing.assert_close(loss2, loss0, rtol=0, atol=0)
    _assert_bitwise(grads1, grads0)
    _assert_bitwise(grads2, grads0)


def test_a_cuda_only_offload_row_is_silent_off_cuda(monkeypatch):
    """``off_cuda="ignore"`` (the ``long_context`` preset's offload row): on CPU the row keeps
    activations where they are without the warning; the rule prints and serialises it."""
    monkeypatch.setattr(ac_apply, "_offload_warned", False)
    model = tiny_ac_model("llama")
    ids = token_batch()
    loss0, grads0 = loss_and_grads(model, ids)
    rule = {"when": "decoder_block", "action": "offload", "off_cuda": "ignore"}
    with warnings.catch_warnings():
        warnings.simplefilter("error", ac_policies.ACPolicyWarning)
        with ac_policies.apply_policy(model, [rule]):
            loss1, grads1 = loss_and_grads(model, ids)
        with ac_policies.apply_policy(model, "long_context"):
            loss_and_grads(model, ids)
    assert ac_apply._offload_warned is False
    torch.testing.assert_close(loss1, loss0, rtol=0, atol=0)
    _assert_bitwise(grads1, grads0)
    parsed = ac_policies.Rule.from_dict(rule)
    assert parsed.to_dict()["off_cuda"] == "ignore" and "off_cuda=ignore" in str(parsed)
    assert any(r.action == "offload" and r.off_cuda == "ignore" for r in ac_policies.PRESETS["long_context"].rules)
    with pytest.raises(ValueError, match="off_cuda only applies to action='offload'"):
        ac_policies.Rule(action="checkpoint", off_cuda="ignore")
    with pytest.raises(ValueError, match="off_cuda must be one of"):
        ac_policies.Rule(action="offload", off_cuda="error")


def test_offload_outside_training_enters_no_region_and_does_not_warn(monkeypatch):
    monkeypatch.setattr(ac_apply, "_offload_warned", False)
    model = _blocks()
    x = torch.randn(4, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ac_policies.ACPolicyWarning)
        with ac_policies.apply_policy(model, [{"match": "*", "when": lambda f, m: isinstance(m, Block), "action": "offload"}]):
            with torch.no_grad():
                model(x)
            model.eval()
            model(x)
    assert ac_apply._offload_warned is False


# ---- the hooks' bookkeeping, on CPU tensors ------------------------------------------------


def test_pack_skips_parameters_buffers_views_of_them_and_small_tensors():
    block = Block(16)
    off = Offloader(device_type="cpu", min_bytes=256)
    region = off.region(block)
    big = torch.randn(8, 16)  # 512 bytes
    small = torch.randn(8)  # 32 bytes
    for kept in (block.up.weight, block.up.weight.t(), block.up.weight.detach(), block.scale, block.scale[:4], small):
        packed = region.pack(kept)
        assert isinstance(packed, torch.Tensor), "kept tensors are saved as they are"
        assert packed.untyped_storage().data_ptr() == kept.untyped_storage().data_ptr()
    assert not region.offloads(nn.Parameter(torch.randn(64, 64)))  # another module's parameter
    assert not region.offloads(nn.Buffer(torch.randn(64, 64)))
    assert region.offloads(big)
    assert not isinstance(region.pack(big), torch.Tensor)
    assert off.stats.offloaded == 1 and off.stats.offloaded_bytes == 512 and off.stats.kept == 6
    assert not Offloader(device_type="cuda", min_bytes=0).region().offloads(big), "a CPU tensor is not a CUDA activation"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_round_trip_is_bitwise_into_a_separate_host_copy(dtype):
    off = Offloader(device_type="cpu", min_bytes=0)
    region = off.region()
    t = (torch.randn(6, 10) * 100).to(dtype)
    if dtype.is_floating_point:
        t[0, :3] = torch.tensor([float("nan"), -0.0, float("inf")], dtype=dtype)
    cases = [t, t.t(), t[:, 2:7], t[::2]]
    packed = [region.pack(c) for c in cases]
    host = [e.host for e in region._entries]
    assert all(h.untyped_storage().data_ptr() != t.untyped_storage().data_ptr() for h in host)
    for c, p in zip(cases, packed):
        back = region.unpack(p)
        assert back.shape == c.shape and back.dtype == c.dtype
        assert back.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
        as_int = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.int64: torch.int64}[dtype]
        assert torch.equal(back.contiguous().view(as_int), c.contiguous().view(as_int))


def test_regions_give_bitwise_gradients_and_prefetch_the_previous_region():
    model = _blocks(n=4)
    x = torch.randn(5, 16, requires_grad=True)
    ref = _run(model, x)
    streams = InlineStreams()
    off = Offloader(device_type="cpu", min_bytes=64, streams=streams)
    got = _run(model, x, off)
    _assert_bitwise(got, ref)
    stats = off.stats
    assert stats.offloaded > 0
    # backward reaches region 3 first (copied back on demand); each region's first unpack prefetches the one before
    assert stats.prefetch_order == [2, 1, 0]
    assert stats.prefetched + stats.fetched == stats.offloaded
    per_region = stats.offloaded // 4
    assert stats.fetched == per_region and stats.prefetched == 3 * per_region
    # every copy back is waited for before its tensor is handed out
    waits = [event for kind, event in streams.log if kind == "wait"]
    backs = [event for kind, event in streams.log if kind == "to_device"]
    assert sorted(waits) == sorted(backs)
    for event in backs:
        assert streams.log.index(("to_device", event)) < streams.log.index(("wait", event))


def test_regions_are_freed_with_their_graph():
    model = _blocks()
    x = torch.randn(5, 16)
    off = Offloader(device_type="cpu", min_bytes=64)
    _run(model, x, off)
    gc.collect()
    assert off.live_regions() == []
    h = x
    for block in model:
        with off.region(block).hooks():
            h = block(h)
    assert [r.number for r in off.live_regions()] == [3, 4, 5]
    del h
    assert off.live_regions() == []


def test_retained_graph_comes_back_twice_bitwise():
    model = _blocks()
    x = torch.randn(5, 16)
    ref = _run(model, x, backwards=2)
    off = Offloader(device_type="cpu", min_bytes=64)
    got = _run(model, x, off, backwards=2)
    _assert_bitwise(got, ref)
    assert off.stats.prefetch_order == [1, 0, 1, 0]


def test_nested_regions_and_a_region_without_large_tensors():
    model = _blocks()
    x = torch.randn(5, 16)
    ref = _run(model, x)
    off = Offloader(device_type="cpu", min_bytes=64)
    model.zero_grad(set_to_none=True)
    with off.region(model[0]).hooks():
        h = model[0](x)
        with off.region(model[1]).hooks():
            h = model[1](h)
    with Offloader(device_type="cpu", min_bytes=1 << 30).region().hooks():
        h = model[2](h)
    h.square().sum().backward()
    _assert_bitwise({n: p.grad for n, p in model.named_parameters()}, ref)


def test_cuda_streams_refuse_nothing_at_construction():
    streams = CudaStreams()  # no CUDA call until the first copy
    assert streams.pin_memory and streams._side == {}
    assert default_offloader("cuda") is default_offloader("cuda")
    assert isinstance(default_offloader("cuda").streams, CudaStreams)


# ---- CUDA --------------------------------------------------------------------------------


class RecordingStreams(CudaStreams):
    """CudaStreams that keep every event they record, in order, with its direction."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[str, torch.cuda.Event]] = []

    def to_host(self, t):
        host, event = super().to_host(t)
        self.events.append(("to_host", event))
        return host, event

    def to_device(self, host, device):
        buf, event = super().to_device(host, device)
        self.events.append(("to_device", event))
        return buf, event


def _deterministic_reference(run):
    ref = run()
    again = run()
    if any(not torch.equal(ref[k], again[k]) for k in ref):
        pytest.skip("the reference step itself is not bitwise reproducible on this device")
    return ref


@pytest.mark.cuda
@needs_cuda
def test_cuda_regions_bitwise_pinned_and_prefetched_with_events():
    model = _blocks(n=4, h=256, device="cuda")
    x = torch.randn(512, 256, device="cuda")
    ref = _deterministic_reference(lambda: _run(model, x))
    streams = RecordingStreams()
    off = Offloader(device_type="cuda", min_bytes=1024, streams=streams)
    got = _run(model, x, off)
    torch.cuda.synchronize()
    _assert_bitwise(got, ref)
    assert off.stats.prefetch_order == [2, 1, 0]
    assert off.stats.prefetched > 0 and off.stats.fetched > 0
    kinds = [k for k, _ in streams.events]
    assert kinds.count("to_host") == off.stats.offloaded
    assert kinds.count("to_device") == off.stats.offloaded
    assert all(isinstance(e, torch.cuda.Event) and e.query() for _, e in streams.events)
    side = streams.side(torch.device("cuda"))
    assert side != torch.cuda.current_stream()


@pytest.mark.cuda
@needs_cuda
def test_cuda_host_copies_are_pinned():
    off = Offloader(device_type="cuda", min_bytes=0)
    region = off.region()
    t = torch.randn(1024, device="cuda")
    packed = region.pack(t)
    assert region._entries[0].host.is_pinned() and region._entries[0].host.device.type == "cpu"
    back = region.unpack(packed)
    torch.cuda.synchronize()
    assert back.device == t.device and torch.equal(back, t)


@pytest.mark.cuda
@needs_cuda
def test_cuda_offload_policy_matches_no_policy_bitwise_without_warning(monkeypatch):
    off = default_offloader("cuda")
    monkeypatch.setattr(off, "min_bytes", 256)
    off.reset()
    model = tiny_ac_model("llama").cuda()
    ids = token_batch().cuda()
    ref = _deterministic_reference(lambda: loss_and_grads(model, ids)[1])
    with warnings.catch_warnings():
        warnings.simplefilter("error", ac_policies.ACPolicyWarning)
        with ac_policies.apply_policy(model, [{"when": "decoder_block", "action": "offload"}]):
            _, got = loss_and_grads(model, ids)
    _assert_bitwise(got, ref)
    assert off.stats.offloaded > 0
    assert off.stats.prefetch_order == [0]  # two decoder layers: the last one's first unpack prefetches the first


@pytest.mark.cuda
@needs_cuda
def test_cuda_offload_frees_device_memory_after_forward():
    model = _blocks(n=4, h=1024, device="cuda")
    x = torch.randn(4096, 1024, device="cuda")  # 16 MiB per [4096, 1024] fp32 activation

    def kept_after_forward(policy) -> int:
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        handle = ac_policies.apply_policy(model, policy) if policy else None
        loss = model(x).square().sum()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # frees blocks whose side-stream copies have finished
        kept = torch.cuda.memory_allocated() - base
        loss.backward()
        if handle:
            handle.remove()
        return kept

    none = kept_after_forward(None)
    offload = kept_after_forward([{"match": "*", "when": lambda f, m: isinstance(m, Block), "action": "offload"}])
    # each block saves about 5 activations of 16-32 MiB; offloaded, only the block inputs remain
    assert offload < 0.5 * none, (offload, none)
