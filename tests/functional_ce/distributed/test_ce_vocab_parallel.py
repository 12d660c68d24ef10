"""Vocabulary-parallel cross-entropy on DTensor: 2, 3 and 4 gloo processes, 1-D and 2-D meshes.

Every case is compared with the fp64 single-process reference (loss and every gradient), and
the bytes each process hands to collectives are counted in forward and backward separately.
V = 509 makes every vocabulary shard uneven. The processes are spawned once for the module.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.harness.dist_pool import dist_pool_fixture
from tests.functional_ce.ce_cases import ROUNDING, absmax, make_case, worst
from tests.functional_ce.distributed.workers import vocab_parallel as tasks
from tests.functional_ce.linear_cases import make_linear_case, reference_linear
from tests.support.reference import reference_cross_entropy

V = 509
#: (mesh shape, the mesh dim that shards the vocabulary): 2, 3, 4 processes, and a 2x2 mesh
#: with the vocabulary on either dim (the other one Replicate()).
MESHES = [((2,), 0), ((3,), 0), ((4,), 0), ((2, 2), 0), ((2, 2), 1)]
MESH_IDS = ["2", "3", "4", "2x2-dim0", "2x2-dim1"]
#: Each option alone, the reductions, the counts, and everything at once.
OPTION_SETS = [
    {},
    {"reduction": "sum"},
    {"reduction": "none"},
    {"label_smoothing": 0.1},
    {"label_smoothing": 1.0, "reduction": "none"},
    {"z_loss": 1e-3},
    {"softcap": 5.0},
    {"mask": True},
    {"weights": True, "reduction": "none"},
    {"ignore_index": 3},
    {"num_label_tokens": 7, "reduction": "sum"},
    {"num_label_tokens": 0},
    {"label_smoothing": 0.2, "z_loss": 1e-3, "softcap": 8.0, "mask": True, "weights": True, "ignore_index": 7,
     "num_label_tokens": 11},
]
DTYPES = (torch.float32, torch.bfloat16)
#: Per token and process: the MAX all-reduce (4 bytes) and the stacked SUM (8 or 12 bytes).
MAX_FORWARD_BYTES_PER_TOKEN = 64


pool = dist_pool_fixture(4)


def _upstream_backward(out: torch.Tensor, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    up = tasks._upstream(out.shape, 1).to(out.dtype)
    return list(torch.autograd.grad((out * up).sum(), leaves))


def _logits_reference(seed, batch_shape, v, dtype, kwargs, ref_dtype):
    case = make_case(seed, batch_shape, v, dtype, **dict(kwargs))
    x = case.logits.detach().clone().requires_grad_()
    out = reference_cross_entropy(x, case.labels, dtype=ref_dtype, **case.kwargs)
    (g,) = _upstream_backward(out, [x])
    return out.detach(), g


def _check_logits(result: tasks.RankResult, seed, batch_shape, dtype, kwargs, v=V) -> None:
    """|ours - truth| <= |fp32 single-process definition - truth| + tol, loss and gradient."""
    truth, g_truth = _logits_reference(seed, batch_shape, v, dtype, kwargs, torch.float64)
    naive, g_naive = _logits_reference(seed, batch_shape, v, dtype, kwargs, torch.float32)
    assert result.loss.dtype == torch.float32 and result.loss.shape == truth.shape
    tol = 1e-5 * (1 + absmax(truth))
    excess = worst((result.loss.double() - truth).abs() - (naive.double() - truth).abs() - tol)
    assert excess <= 0, f"loss exceeds the single-process fp32 error by {excess:.3g} ({kwargs})"
    (grad,) = result.grads
    assert grad.dtype == dtype and grad.shape == (*batch_shape, v)
    g_naive = g_naive.to(dtype).double()
    gtol = ROUNDING[dtype] * (1 + absmax(g_truth))
    gexcess = worst((grad.double() - g_truth).abs() - (g_naive - g_truth).abs() - gtol)
    assert gexcess <= 0, f"gradient exceeds the single-process error by {gexcess:.3g} ({kwargs})"


def _check_linear(result: tasks.RankResult, seed, batch_shape, h, v, dtype, kwargs, bias, processes) -> None:
    """The hidden-state form's loss and gradients against the fp64 reference, with the error of
    the single-process naive path (``F.linear`` in the input dtype, the loss in fp32) as slack."""
    case = make_linear_case(seed, batch_shape, h, v, dtype, bias=bias, **dict(kwargs))
    leaves = [t.detach().clone().requires_grad_() for t in (case.hidden, case.weight, case.bias) if t is not None]
    truth = reference_linear(*leaves[:2], case.labels, bias=leaves[2] if bias else None, **case.kwargs)
    g_truth = _upstream_backward(truth, leaves)
    leaves_n = [t.detach().clone().requires_grad_() for t in leaves]
    naive = reference_linear(*leaves_n[:2], case.labels, bias=leaves_n[2] if bias else None, dtype=None,
                             **case.kwargs)
    g_naive = _upstream_backward(naive, leaves_n)
    truth, naive = truth.detach(), naive.detach()
    tol = 1e-5 * (1 + absmax(truth))
    excess = worst((result.loss.double() - truth).abs() - (naive.double() - truth).abs() - tol)
    assert excess <= 0, f"loss exceeds the single-process error by {excess:.3g} ({kwargs})"
    # Each process's hidden gradient is a partial sum over its classes, rounded to the input
    # dtype before DTensor adds them: one more rounding per process.
    for name, g, gt, gn in zip(("hidden", "weight", "bias"), result.grads, g_truth, g_naive):
        assert g.dtype == dtype and g.shape == gt.shape, name
        gtol = ROUNDING[dtype] * (1 + absmax(gt)) * (processes if name == "hidden" else 1)
        gexcess = worst((g.double() - gt).abs() - (gn.double() - gt).abs() - gtol)
        assert gexcess <= 0, f"grad {name} exceeds the single-process error by {gexcess:.3g} ({kwargs})"


def _check_logits_bytes(result: tasks.RankResult, n_tokens: int) -> None:
    assert result.forward_bytes <= MAX_FORWARD_BYTES_PER_TOKEN * n_tokens, result.by_op
    assert set(result.by_op) <= {"all_reduce"}, result.by_op
    assert result.backward_bytes == 0


@pytest.mark.parametrize("mesh_shape,mesh_dim", MESHES, ids=MESH_IDS)
def test_logits_form_every_option_matches_fp64_reference(pool, mesh_shape, mesh_dim):
    batch_shape = (3, 7)
    # Labels, mask and weights are plain tensors, or Replicate() DTensors in every other case.
    cases = [
        (mesh_dim, seed, batch_shape, V, dtype, kwargs, inplace, None, (seed + inplace) % 2 == 1)
        for seed, kwargs in enumerate(OPTION_SETS)
        for dtype in DTYPES
        for inplace in (False, True)
    ]
    per_rank = pool.run(tasks.many, mesh_shape, tasks.logits_case, cases)
    ranks = [r for r in per_rank if r is not None]
    assert len(ranks) == math.prod(mesh_shape)
    for i, (_, seed, shape, _, dtype, kwargs, inplace, _, _) in enumerate(cases):
        first = ranks[0][i]
        for other in ranks[1:]:  # the loss is replicated: the same on every process
            assert torch.equal(other[i].loss, first.loss)
            assert torch.equal(other[i].grads[0], first.grads[0])
        _check_logits(first, seed, shape, dtype, kwargs)
        for r in ranks:
            _check_logits_bytes(r[i], math.prod(shape))
            assert all(repr(p) == "Replicate()" for p in r[i].loss_placements)
            vocab_placement = repr(r[i].grad_placements[0][mesh_dim])
            assert vocab_placement == f"Shard(dim={len(shape)})", r[i].grad_placements
            if inplace:
                # The gradient handed to the logits lives in their own storage.
                assert r[i].grad_reaching_logits_is_storage


def test_inplace_gradient_is_the_logits_storage_on_even_shards(pool):
    # 512 classes over 2 processes: the leaf's .grad keeps the storage. With uneven shards the
    # gradient reaching the leaf is still the storage (checked above), but autograd copies it
    # when it stores .grad: DTensor derives the gradient's global stride from the padded shard.
    per_rank = pool.run(tasks.logits_case, (2,), 0, 0, (4, 3), 512, torch.float32, {}, True)
    assert [r.grad_is_logits_storage for r in per_rank[:2]] == [True, True]


@pytest.mark.parametrize(
    "mesh_shape,mesh_dim,token_dim",
    [((2,), 0, None), ((3,), 0, 1), ((4,), 0, 0), ((2, 2), 0, None), ((2, 2), 1, 1)],
    ids=["2-replicate", "3-seq-parallel", "4-seq-parallel-dim0", "2x2-dim0-replicate", "2x2-dim1-seq-parallel"],
)
def test_hidden_form_every_option_matches_fp64_reference(pool, mesh_shape, mesh_dim, token_dim):
    batch_shape, h = (3, 7), 16
    cases = [
        (mesh_dim, seed, batch_shape, h, V, dtype, kwargs, seed % 2 == 0, token_dim, None, 1, None, "auto",
         dtype == torch.bfloat16)
        for seed, kwargs in enumerate(OPTION_SETS)
        for dtype in DTYPES
    ]
    per_rank = pool.run(tasks.many, mesh_shape, tasks.linear_case, cases)
    ranks = [r for r in per_rank if r is not None]
    n_tokens = math.prod(batch_shape)
    for i, (_, seed, shape, h, v, dtype, kwargs, bias, *_) in enumerate(cases):
        first = ranks[0][i]
        _check_linear(first, seed, shape, h, v, dtype, kwargs, bias, processes=mesh_shape[mesh_dim])
        hidden_placement = "Replicate()" if token_dim is None else f"Shard(dim={token_dim})"
        for r in ranks:
            assert torch.equal(r[i].loss, first.loss)
            assert repr(r[i].grad_placements[0][mesh_dim]) == hidden_placement
            assert all(repr(p[mesh_dim]) == "Shard(dim=0)" for p in r[i].grad_placements[1:])
            gathered = r[i].by_op.get("all_gather_into_tensor", 0)
            assert (gathered > 0) == (token_dim is not None)
            # Beyond the token gather: O(N) statistics. Backward: one [N, H] reduction (DTensor
            # pads uneven token shards to equal pieces before a reduce-scatter).
            assert r[i].forward_bytes - gathered <= MAX_FORWARD_BYTES_PER_TOKEN * n_tokens, r[i].by_op
            padded_tokens = n_tokens if token_dim is None else (
                n_tokens // shape[token_dim] * (-(-shape[token_dim] // mesh_shape[mesh_dim]) * mesh_shape[mesh_dim])
            )
            assert 0 < r[i].backward_bytes <= padded_tokens * h * 4


@pytest.mark.parametrize("form", ["logits", "hidden"])
def test_shard_without_labels_and_all_ignored_batches(pool, form):
    # V = 3 over 4 processes: shards of 1, 1, 1 and 0 classes. Labels all 0: only the first
    # process holds a target. Then every label ignored: loss 0, zero gradients.
    for labels_kind in ("first-class-only", "all-ignored"):
        if form == "logits":
            result = pool.run(tasks.degenerate_logits_case, (4,), labels_kind)
        else:
            result = pool.run(tasks.degenerate_linear_case, (4,), labels_kind)
        ref_loss, ref_grads = result[0]["reference"]
        for r in result:
            assert torch.allclose(r["loss"], ref_loss, atol=1e-6), (labels_kind, r["loss"], ref_loss)
            for g, gt in zip(r["grads"], ref_grads):
                assert torch.allclose(g, gt, atol=1e-6), labels_kind


@pytest.mark.parametrize("form", ["logits", "hidden"])
def test_compiled_user_loss_matches_eager(pool, form):
    """A user loss over DTensor inputs compiles with fullgraph=True (aot_eager) and gives the
    eager results."""
    kwargs = {"label_smoothing": 0.1, "z_loss": 1e-3, "weights": True}
    if form == "logits":
        eager = pool.run(tasks.logits_case, (2,), 0, 5, (3, 5), V, torch.float32, kwargs, False, None)
        compiled = pool.run(tasks.logits_case, (2,), 0, 5, (3, 5), V, torch.float32, kwargs, False, "aot_eager")
    else:
        eager = pool.run(tasks.linear_case, (2,), 0, 5, (3, 5), 16, V, torch.float32, kwargs, True, 1, None)
        compiled = pool.run(tasks.linear_case, (2,), 0, 5, (3, 5), 16, V, torch.float32, kwargs, True, 1, "aot_eager")
    for e, c in zip(eager[:2], compiled[:2]):
        assert torch.allclose(c.loss, e.loss, rtol=1e-6, atol=1e-6)
        for ge, gc in zip(e.grads, c.grads):
            assert torch.allclose(gc, ge, rtol=1e-5, atol=1e-6)
        assert c.grad_placements == e.grad_placements
        assert c.backward_bytes == e.backward_bytes  # the compiled backward communicates the same


@pytest.mark.slow
@pytest.mark.parametrize("form", ["logits", "hidden"])
def test_inductor_compiled_user_loss_matches_eager(pool, form):
    kwargs = {"label_smoothing": 0.1, "softcap": 5.0}
    if form == "logits":
        eager = pool.run(tasks.logits_case, (2,), 0, 6, (2, 5), V, torch.float32, kwargs, False, None)
        compiled = pool.run(tasks.logits_case, (2,), 0, 6, (2, 5), V, torch.float32, kwargs, False, "inductor")
    else:
        eager = pool.run(tasks.linear_case, (2,), 0, 6, (2, 5), 16, V, torch.float32, kwargs, False, None, None)
        compiled = pool.run(tasks.linear_case, (2,), 0, 6, (2, 5), 16, V, torch.float32, kwargs, False, None,
                            "inductor")
    for e, c in zip(eager[:2], compiled[:2]):
        assert torch.allclose(c.loss, e.loss, rtol=1e-5, atol=1e-6)
        for ge, gc in zip(e.grads, c.grads):
            assert torch.allclose(gc, ge, rtol=1e-4, atol=1e-6)


def test_compiled_chunk_graphs_serve_each_slice(pool):
    """The default eager path (inductor-compiled chunk graphs) on each process's own slice."""
    kwargs = {"label_smoothing": 0.1, "ignore_index": 3}
    cases = [(0, 9, (2, 6), V, torch.float32, kwargs, False, None, False, 1, True)]
    per_rank = pool.run(tasks.many, (2,), tasks.logits_case, cases)
    _check_logits(per_rank[0][0], 9, (2, 6), torch.float32, kwargs)
    linear = [(0, 9, (2, 6), 16, V, torch.float32, kwargs, True, None, None, 1, True)]
    per_rank = pool.run(tasks.many, (2,), tasks.linear_case, linear)
    eager = pool.run(tasks.linear_case, (2,), 0, 9, (2, 6), 16, V, torch.float32, kwargs, True)
    for c, e in zip(per_rank[0][0].grads, eager[0].grads):
        assert torch.allclose(c, e, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("form", ["logits", "hidden"])
def test_no_tokens_by_vocabulary_buffer_beyond_a_chunk(pool, form):
    """Each process allocates vocabulary-wide buffers of one chunk at most, besides the gradient
    it must return: the logits' gradient ``[N, V_local]`` (in the logits' dtype) or the weight's
    ``[V_local, H]``. No fp32 ``[N, V_local]`` copy, and no ``[N, V_local]`` logits from hidden states."""
    # 510 classes: even shards, so autograd stores the logits' gradient as it is (with uneven
    # shards it copies it into the leaf's layout, see test_inplace_gradient_is_the_logits_storage).
    n, h, chunk = 64, 16, 8
    per_rank = pool.run(tasks.traced_allocations, (2,), form, n, h, 510, chunk)
    for r in per_rank[:2]:
        local_v = r["local_v"]
        # A same-dtype .to() returns its input: not an allocation.
        by_vocab = [(op, shape, dtype) for op, shape, dtype in r["records"] if local_v in shape and op != "aten::to"]
        assert any(math.prod(shape) == chunk * local_v for _, shape, _ in by_vocab), "no chunk of local logits"
        larger = [rec for rec in by_vocab if math.prod(rec[1]) > chunk * local_v]
        allowed = (n, local_v) if form == "logits" else (local_v, h)
        assert [shape for _, shape, _ in larger] == [allowed], larger


@pytest.mark.parametrize(
    "mesh_shape,fsdp_dims", [((2,), (0,)), ((4,), (0,)), ((2, 2), (1,))], ids=["2", "4", "2x2-hsdp"]
)
def test_fsdp2_sharded_head_with_plain_hidden_states(pool, mesh_shape, fsdp_dims):
    """FSDP2's layout (sharded parameters, plain per-process activations): each process's loss is
    its own; the weight's gradient is the sum over processes, sharded like the weight."""
    cases = [
        (fsdp_dims, seed, (3, 5), 16, 37, dtype, kwargs, seed % 2 == 0)
        for seed, kwargs in enumerate([{}, {"label_smoothing": 0.1, "z_loss": 1e-3, "reduction": "sum"},
                                       {"reduction": "none", "softcap": 4.0, "ignore_index": 2}])
        for dtype in (torch.float32, torch.bfloat16)
    ]
    per_rank = [r for r in pool.run(tasks.many, mesh_shape, tasks.fsdp_case, cases) if r is not None]
    for i, (_, _, _, _, _, dtype, kwargs, bias) in enumerate(cases):
        results = [r[i] for r in per_rank]
        summed = [sum(r["reference"][1][k] for r in results) for k in range(1, 2 + bias)]
        for r in results:
            ref_loss, ref_grads = r["reference"]
            assert r["is_plain"]
            tol = 1e-5 if dtype == torch.float32 else 3e-2
            assert torch.allclose(r["loss"].double(), ref_loss, rtol=tol, atol=tol), kwargs
            g_tol = 1e-5 if dtype == torch.float32 else 3e-2 * len(results)
            assert torch.allclose(r["grads"][0].double(), ref_grads[0], rtol=g_tol, atol=g_tol), kwargs
            for got, want in zip(r["grads"][1:], summed):
                assert got.dtype == dtype
                assert torch.allclose(got.double(), want, rtol=g_tol, atol=g_tol * (1 + want.abs().max())), kwargs
            for placements in r["grad_placements"]:
                assert [repr(p) for p in placements] == [
                    "Shard(dim=0)" if d in fsdp_dims else "Replicate()" for d in range(len(mesh_shape))
                ]
            assert "reduce_scatter_tensor" in r["backward_by_op"], r["backward_by_op"]


@pytest.mark.parametrize("case", tasks.LAYOUT_ERRORS, ids=[c for c in tasks.LAYOUT_ERRORS])
def test_unsupported_layouts_raise_naming_the_placements(pool, case):
    messages = pool.run(tasks.raises, (2, 2), case)
    for message in messages:
        assert message is not None and message.startswith("ValueError"), message
        assert tasks.LAYOUT_ERRORS[case] in message, message


@settings(max_examples=6)
@given(
    seed=st.integers(0, 2**31 - 1),
    batch_shape=st.lists(st.integers(1, 6), min_size=1, max_size=3).map(tuple),
    v=st.integers(1, 40),
    mesh=st.sampled_from(MESHES),
    dtype=st.sampled_from(DTYPES),
    opts=st.fixed_dictionaries(
        {},
        optional={
            "reduction": st.sampled_from(["mean", "sum", "none"]),
            "label_smoothing": st.sampled_from([0.0, 0.1, 1.0]),
            "z_loss": st.sampled_from([0.0, 1e-3]),
            "softcap": st.sampled_from([None, 4.0]),
            "mask": st.just(True),
            "weights": st.just(True),
            "chunk_size": st.sampled_from([None, 1, 4, "auto"]),
        },
    ),
)
def test_property_any_shape_vocabulary_and_options(pool, seed, batch_shape, v, mesh, dtype, opts):
    """Both forms; vocabularies smaller than the process count (empty shards) included."""
    mesh_shape, mesh_dim = mesh
    opts = dict(opts)
    chunk_size = opts.pop("chunk_size", "auto")
    # Hidden states Replicate() or sequence parallel over any token dim.
    bias, token_dim = seed % 2 == 0, (None if seed % 3 == 0 else seed % len(batch_shape))
    per_rank = pool.run(tasks.many_tasks, mesh_shape, [
        (tasks.logits_case, (mesh_dim, seed, batch_shape, v, dtype, opts, seed % 2 == 0, None, False, 1, None,
                             chunk_size)),
        (tasks.linear_case, (mesh_dim, seed, batch_shape, 8, v, dtype, opts, bias, token_dim, None, 1, None,
                             chunk_size)),
    ])
    ranks = [r for r in per_rank if r is not None]
    _check_logits(ranks[0][0], seed, batch_shape, dtype, opts, v=v)
    _check_linear(ranks[0][1], seed, batch_shape, 8, v, dtype, opts, bias, processes=mesh_shape[mesh_dim])
    for r in ranks:
        _check_logits_bytes(r[0], math.prod(batch_shape))


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_every_batch_shape_over_a_sharded_vocabulary(pool, reduction):
    """An unbatched sample ``[V]`` (``[H]`` hidden) and 1 to 3 token dims, both forms, over 2 and
    3 processes; hidden states sequence-parallel over their last token dim where there is one."""
    shapes = [(), (5,), (2, 3), (2, 2, 2)]
    opts = {"reduction": reduction, "mask": True}
    calls = []
    for seed, shape in enumerate(shapes):
        calls.append((tasks.logits_case, (0, seed, shape, V, torch.float32, opts)))
        calls.append((tasks.linear_case, (0, seed, shape, 8, V, torch.float32, opts, True,
                                          len(shape) - 1 if shape else None)))
    for processes in (2, 3):
        ranks = [r for r in pool.run(tasks.many_tasks, (processes,), calls) if r is not None]
        assert len(ranks) == processes
        for r in ranks:
            for i, shape in enumerate(shapes):
                logits_result, linear_result = r[2 * i], r[2 * i + 1]
                assert logits_result.loss.shape == (shape if reduction == "none" else ())
                assert linear_result.loss.shape == (shape if reduction == "none" else ())
                _check_logits(logits_result, i, shape, torch.float32, opts)
                _check_linear(linear_result, i, shape, 8, V, torch.float32, opts, True, processes=processes)
