"""torch.compile: the compile ladder around a user loss on top of the default (compiled chunk)
path, the per-configuration chunk graphs, and the narrow fallback."""

from __future__ import annotations

import logging

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

import functional_ce
from functional_ce import compiled_chunks as compiled
from tests.functional_ce.ce_cases import COMPILED_OPTIONS, COMPILED_V, ROUNDING, Case, loss_and_grad, make_case

V = 96
OPTS = dict(reduction="mean", z_loss=1e-4, label_smoothing=0.1, softcap=30.0, chunk_size=8)


def _user_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """What a training loop compiles: a head projection, then our loss on its default path."""
    logits = (hidden @ weight.T).to(torch.bfloat16)
    return functional_ce.cross_entropy(logits, labels, **OPTS)


def _batch(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, 16, generator=g, requires_grad=True)
    labels = torch.randint(0, V, (n,), generator=g)
    labels[::5] = -100
    return hidden, labels


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_compile_ladder_fullgraph_no_breaks_one_recompile(backend, monkeypatch):
    monkeypatch.delenv("FUNCTIONAL_CE_COMPILE", raising=False)  # the default path: compiled chunks
    torch._dynamo.reset()
    counters.clear()
    weight = torch.randn(V, 16, generator=torch.Generator().manual_seed(9), requires_grad=True)
    counter = CompileCounterWithBackend(backend)
    compiled_loss = torch.compile(_user_loss, backend=counter, fullgraph=True)
    monkeypatch.setattr(compiled, "_graphs", {})  # count this test's chunk graphs only
    for step, n in enumerate([24, 37, 53]):  # only the token count changes between steps
        hidden, labels = _batch(n, step)
        ref = _user_loss(hidden, weight, labels)
        ref_grads = torch.autograd.grad(ref, (hidden, weight))
        got = compiled_loss(hidden, weight, labels)
        got_grads = torch.autograd.grad(got, (hidden, weight))
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        for g, r in zip(got_grads, ref_grads):
            torch.testing.assert_close(g, r, rtol=2e-2, atol=1e-4)
    assert dict(counters["graph_break"]) == {}
    assert counter.frame_count <= 2, f"{counter.frame_count} compilations for 3 token counts (at most 2 allowed)"
    # The user's graph called the operators, whose chunk loops ran compiled chunk graphs.
    served = compiled.compiled_configurations()
    assert len(served) == 2 and all(n >= 1 for n in served.values()), served  # forward and backward


def test_inplace_grad_inside_torch_compile_keeps_logits_and_matches():
    logits = torch.randn(12, V, dtype=torch.bfloat16, requires_grad=True)
    before = logits.detach().clone()
    labels = torch.randint(0, V, (12,))
    fn = torch.compile(
        lambda x, y: functional_ce.cross_entropy(x, y, inplace_grad=True), backend="aot_eager", fullgraph=True
    )
    fn(logits, labels).backward()
    (expected,) = torch.autograd.grad(functional_ce.cross_entropy(before.requires_grad_(), labels), before)
    assert torch.equal(logits.grad, expected)
    assert torch.equal(logits.detach(), before.detach()), "documented: ignored under compile, logits intact"


OPTION_MATRIX = [
    {},
    {"label_smoothing": 0.1},
    {"z_loss": 1e-4},
    {"softcap": 30.0},
    {"ignore_index": 3},
    COMPILED_OPTIONS[1],
    dict(COMPILED_OPTIONS[1], reduction="none", mask=True, weights=True),
    dict(COMPILED_OPTIONS[1], reduction="sum", num_label_tokens=9),
]


@pytest.mark.parametrize("opts", OPTION_MATRIX, ids=lambda o: "+".join(sorted(o)) or "defaults")
def test_compiled_chunk_graphs_match_eager_chunk_maths(opts):
    """The default eager path runs inductor-compiled chunk graphs; they agree with the eager maths."""
    before = set(compiled.compiled_configurations())
    for seed, n in enumerate([40, 29]):  # a second token count reuses the dynamic-row graphs
        case = make_case(seed, (n,), COMPILED_V, torch.bfloat16, **dict(opts))
        ours, g = loss_and_grad(functional_ce.cross_entropy, case, chunk_size=16, compile_chunks=True)
        ref, g_ref = loss_and_grad(functional_ce.cross_entropy, case, chunk_size=16, compile_chunks=False)
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(g.float(), g_ref.float(), rtol=0, atol=ROUNDING[torch.bfloat16])
    served = compiled.compiled_configurations()
    assert all(served[k] >= 1 for k in set(served) - before)


#: (V, dtype, options): the vocabularies, dtypes and options of a job that trains, evaluates
#: on a second vocabulary and tries a few option sets, all in one process.
TWELVE = [
    (97, torch.float32, {}),
    (3001, torch.bfloat16, {}),
    (97, torch.bfloat16, {"z_loss": 1e-4}),
    (509, torch.float32, {"label_smoothing": 0.1}),
    (1024, torch.bfloat16, {"softcap": 30.0}),
    (2048, torch.float32, {"z_loss": 1e-3, "softcap": 20.0}),
    (3001, torch.float32, {"label_smoothing": 0.2, "z_loss": 1e-4}),
    (128, torch.bfloat16, {"label_smoothing": 0.1, "softcap": 10.0}),
    (257, torch.float32, {}),
    (997, torch.bfloat16, {"z_loss": 1e-4, "label_smoothing": 0.05}),
    (1500, torch.float32, {"softcap": 50.0}),
    (200, torch.bfloat16, {"ignore_index": 3}),
]


@pytest.mark.slow  # 24 compiled calls, about a minute on 2 cores cold; the compile ladder below runs by default
def test_twelve_configurations_in_one_process_all_stay_compiled(monkeypatch, caplog):
    """More configurations than dynamo's recompile limit: every one correct and compiled, and the
    first ones are still served by their graphs after the last."""
    monkeypatch.delenv("FUNCTIONAL_CE_COMPILE", raising=False)
    assert len(TWELVE) > torch._dynamo.config.recompile_limit  # more than one code object could hold
    caplog.set_level(logging.WARNING)
    keys_seen = []
    for round_ in range(2):  # the second round must reuse every graph of the first
        for i, (v, dtype, opts) in enumerate(TWELVE):
            case = make_case(100 + i, (37,), v, dtype, **opts)
            before = set(compiled.compiled_configurations())
            ours, g = loss_and_grad(functional_ce.cross_entropy, case, chunk_size=16)
            ref, g_ref = loss_and_grad(functional_ce.cross_entropy, case, chunk_size=16, compile_chunks=False)
            torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(g.float(), g_ref.float(), rtol=0, atol=ROUNDING[dtype])
            new = set(compiled.compiled_configurations()) - before
            if round_ == 0:
                keys_seen.append(new)
            else:
                assert not new, f"configuration {i} was compiled again: {new}"
    served = compiled.compiled_configurations()
    for i, keys in enumerate(keys_seen):
        assert keys, f"configuration {i} ({TWELVE[i]}) did not reach the compiled path"
        assert all(served[k] >= 1 for k in keys), f"configuration {i} is not served by a compiled graph"
    noise = [r.getMessage() for r in caplog.records if "functional_ce" in r.name or "recompile" in r.getMessage()]
    assert noise == [], noise


def _fail_compile_with(monkeypatch, exc: BaseException, calls: list) -> None:
    """Every new configuration's compiled graph raises ``exc`` when called."""

    def fake_compile(fn, **kwargs):
        def graph(*args, **kw):
            calls.append(fn.__name__)
            raise exc

        return graph

    monkeypatch.setattr(compiled, "_graphs", {})
    monkeypatch.setattr(compiled.torch, "compile", fake_compile)


def test_a_compiler_failure_falls_back_for_that_configuration_only(monkeypatch, caplog):
    from torch._inductor.exc import InvalidCxxCompiler

    monkeypatch.setattr(compiled, "_graphs", {})
    good = make_case(0, (10,), COMPILED_V, torch.float32)
    loss_and_grad(functional_ce.cross_entropy, good, compile_chunks=True)  # compiled for real
    good_keys = set(compiled.compiled_configurations())
    real_graphs = dict(compiled._graphs)
    calls: list = []
    _fail_compile_with(monkeypatch, InvalidCxxCompiler(), calls)
    compiled._graphs.update(real_graphs)  # configurations compiled before keep their graphs
    case = make_case(1, (10,), 50, torch.float32)
    with caplog.at_level(logging.WARNING, logger="functional_ce.compiled_chunks"):
        got, g = loss_and_grad(functional_ce.cross_entropy, case, compile_chunks=True)
        again, g_again = loss_and_grad(functional_ce.cross_entropy, case, compile_chunks=True)
    ref, g_ref = loss_and_grad(functional_ce.cross_entropy, case, compile_chunks=False)
    assert torch.equal(got, ref) and torch.equal(g, g_ref) and torch.equal(again, ref)
    assert calls == ["forward_into", "backward_into"], "each failing configuration is tried once"
    assert "InvalidCxxCompiler" in caplog.text and "FUNCTIONAL_CE_COMPILE=0" in caplog.text
    status = compiled.compiled_configurations()
    assert sorted(n for k, n in status.items() if k not in good_keys) == [0, 0]
    assert all(status[k] >= 1 for k in good_keys), "a failure elsewhere disabled a compiled configuration"
    # ... and the configuration compiled before still runs its graph, not the failing compiler.
    loss_and_grad(functional_ce.cross_entropy, good, compile_chunks=True)
    assert calls == ["forward_into", "backward_into"]


@pytest.mark.parametrize(
    "exc",
    [torch.OutOfMemoryError("CPU out of memory"), RuntimeError("device-side assert triggered"),
     IndexError("index 70 is out of bounds")],
    ids=["oom", "device-assert", "bad-index"],
)
def test_errors_that_are_not_compiler_failures_propagate(monkeypatch, caplog, exc):
    calls: list = []
    _fail_compile_with(monkeypatch, exc, calls)
    case = make_case(2, (6,), 31, torch.float32)
    with caplog.at_level(logging.WARNING, logger="functional_ce.compiled_chunks"):
        with pytest.raises(type(exc), match=str(exc).split()[0]):
            functional_ce.cross_entropy(case.logits, case.labels, compile_chunks=True)
    assert caplog.text == "", "no fallback, no warning: the error reaches the caller"
    assert all(n == 0 for n in compiled.compiled_configurations().values()) and None not in compiled._graphs.values()


def test_a_wrapped_out_of_memory_is_not_taken_for_a_compiler_failure(monkeypatch):
    from torch._dynamo.exc import BackendCompilerFailed

    wrapped = BackendCompilerFailed("inductor", torch.OutOfMemoryError("out of memory while autotuning"), None)
    _fail_compile_with(monkeypatch, wrapped, [])
    case = make_case(3, (6,), 31, torch.float32)
    with pytest.raises(BackendCompilerFailed):
        functional_ce.cross_entropy(case.logits, case.labels, compile_chunks=True)


def test_environment_opt_out_and_default(monkeypatch):
    calls: list = []
    monkeypatch.setattr(compiled, "_graphs", {})
    monkeypatch.setattr(compiled.torch, "compile", lambda fn, **kw: calls.append(fn.__name__) or fn)
    case = Case(torch.randn(3, 5, requires_grad=True), torch.tensor([0, 1, 2]), {})
    monkeypatch.setenv("FUNCTIONAL_CE_COMPILE", "0")
    loss_and_grad(functional_ce.cross_entropy, case)
    assert calls == []
    monkeypatch.delenv("FUNCTIONAL_CE_COMPILE")
    loss_and_grad(functional_ce.cross_entropy, case)
    assert calls == ["forward_into", "backward_into"], "without the variable, eager calls compile their chunks"


@pytest.mark.parametrize("mode", ["FlopCounterMode", "AllocationTrace"])
def test_under_a_dispatch_mode_the_chunk_maths_runs_eagerly(mode):
    """Dynamo does not compile under a Python dispatch mode (FlopCounterMode, a selective-checkpoint
    policy, a memory trace): the default path must still work there, running the eager maths."""
    from torch.utils.flop_counter import FlopCounterMode

    from tests.support.alloc_trace import AllocationTrace

    make_mode = {"FlopCounterMode": lambda: FlopCounterMode(display=False), "AllocationTrace": AllocationTrace}[mode]
    case = make_case(4, (12,), COMPILED_V, torch.float32, **COMPILED_OPTIONS[1])
    with make_mode() as default_mode:
        got, g = loss_and_grad(functional_ce.cross_entropy, case, chunk_size=5, compile_chunks=True)
    with make_mode() as eager_mode:
        ref, g_ref = loss_and_grad(functional_ce.cross_entropy, case, chunk_size=5, compile_chunks=False)
    assert torch.equal(got, ref) and torch.equal(g, g_ref)
    if mode == "AllocationTrace":  # it opens the operators: the same eager ops ran inside
        assert default_mode.records and default_mode.records == eager_mode.records
