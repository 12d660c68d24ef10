"""The chunk workspace a ``functional_ce`` operator reports (:func:`functional_ce.workspace.workspace_bytes`,
run on fake tensors) against what its loop allocates when it runs on real tensors (eager chunk
maths, every temporary counted while alive), with 300 rows in chunks of 64 (so extrapolated from
two and four chunks), and how it follows the chunk size."""

from __future__ import annotations

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import functional_ce
from functional_ce.operators import IMPLEMENTATIONS
from functional_ce.workspace import is_operator, workspace_bytes


class _RealInside(TorchDispatchMode):
    """Runs each functional_ce operator's implementation on its real arguments and records the most
    bytes its new storages held at once, less its outputs; and the reported workspace."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not is_operator(func):
            return func(*args, **kwargs)
        reported = workspace_bytes(func, args, kwargs)
        inputs = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        live: dict[int, tuple[StorageWeakRef, int]] = {}
        peak = 0

        class Count(TorchDispatchMode):
            def __torch_dispatch__(self, f, types, a=(), k=None):
                nonlocal peak
                out = f(*a, **(k or {}))
                for t in tree_leaves(out):
                    if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in inputs:
                        st = t.untyped_storage()
                        live.setdefault(st._cdata, (StorageWeakRef(st), st.nbytes()))
                for key in [k for k, (ref, _) in live.items() if ref.expired()]:
                    del live[key]
                peak = max(peak, sum(n for _, n in live.values()))
                return out

        with Count():
            out = IMPLEMENTATIONS[f"functional_ce::{func._opname}"](*args, **kwargs)
        returned = sum({t.untyped_storage()._cdata: t.untyped_storage().nbytes()
                        for t in tree_leaves(out) if isinstance(t, torch.Tensor)}.values())
        self.seen.append((func._opname, peak - returned, reported))
        return out


LOSSES = {
    "linear_cross_entropy": lambda h, w, y, c: functional_ce.linear_cross_entropy(h, w, y, chunk_size=c),
    "linear_cross_entropy_backward_recompute": lambda h, w, y, c: functional_ce.linear_cross_entropy(
        h, w, y, chunk_size=c, recompute_logits_in_backward=True),
    "cross_entropy_logits": lambda h, w, y, c: functional_ce.cross_entropy(h @ w.t(), y, chunk_size=c),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("loss", list(LOSSES))
def test_reported_workspace_is_what_the_loop_allocates(loss, dtype, monkeypatch):
    monkeypatch.setenv("FUNCTIONAL_CE_COMPILE", "0")  # the eager chunk path: every temporary is real
    torch.manual_seed(0)
    h = torch.randn(300, 32, dtype=dtype, requires_grad=True)
    w = torch.randn(1000, 32, dtype=dtype, requires_grad=True)
    y = torch.randint(0, 1000, (300,))
    y[::7] = -100
    inside = _RealInside()
    with inside:
        LOSSES[loss](h, w, y, 64).backward()
    assert inside.seen
    for name, real, reported in inside.seen:
        # past four chunks the report is extrapolated from two and four chunks of rows, with the
        # count of valid rows scaled to them (rounded): a few bytes of index either way
        assert abs(reported - real) <= 0.001 * real + 64, (name, real, reported)
    assert max(r for _, _, r in inside.seen) >= 64 * 1000 * 4  # at least one fp32 chunk of logits


def test_compiled_chunks_report_their_matmuls_and_outputs_only(monkeypatch):
    """With compiled chunk graphs a chunk holds its logits (a matmul output) and the gradients it
    returns, not the eager maths' pointwise temporaries: less than the eager report, at least one
    fp32 chunk of logits."""
    h = torch.randn(512, 32, requires_grad=True)
    w = torch.randn(2000, 32, requires_grad=True)
    y = torch.randint(0, 2000, (512,))
    reports = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("FUNCTIONAL_CE_COMPILE", flag)
        inside = _RealInside()
        with inside:
            functional_ce.linear_cross_entropy(h, w, y, chunk_size=128).backward()
        reports[flag] = max(r for _, _, r in inside.seen)
    assert 128 * 2000 * 4 <= reports["1"] < 0.7 * reports["0"], reports


def test_workspace_follows_the_chunk_size_and_is_zero_for_other_ops():
    h = torch.randn(512, 32)
    w = torch.randn(2000, 32)
    y = torch.randint(0, 2000, (512,))
    sizes = {}
    for chunk in (64, 128, 256):
        inside = _RealInside()
        with inside:
            functional_ce.linear_cross_entropy(h.requires_grad_(), w.requires_grad_(), y, chunk_size=chunk).backward()
        sizes[chunk] = max(r for _, _, r in inside.seen)
    assert sizes[128] > 1.6 * sizes[64] and sizes[256] > 1.6 * sizes[128], sizes
    assert workspace_bytes(torch.ops.aten.mm.default, (h, w.t())) == 0
