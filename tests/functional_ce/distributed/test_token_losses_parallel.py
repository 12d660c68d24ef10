"""Token log-probs with entropy, and distillation, on a vocabulary sharded with DTensor (tensor and
sequence parallelism) and on FSDP2-sharded heads: 2, 3 and 4 gloo processes, 1-D and 2-D meshes.

Every process compares with the fp64 single-process reference of the same call, and counts the
bytes it hands to collectives in forward and in backward. V = 509 makes every vocabulary shard
uneven; V = 3 over 4 processes leaves one shard empty. One pool of processes serves the module.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from bench.harness.dist_pool import dist_pool_fixture
from tests.functional_ce.ce_cases import ROUNDING, absmax
from tests.functional_ce.distributed.workers import token_losses_parallel as tasks
from tests.functional_ce.distributed.workers.token_losses_parallel import TokenCase

V = 509
MESHES = [((2,), 0), ((3,), 0), ((4,), 0), ((2, 2), 1)]
MESH_IDS = ["2", "3", "4", "2x2-dim1"]
#: The target of the issue: forward statistics per token and process (MAX, then one SUM per pass).
MAX_FORWARD_BYTES_PER_TOKEN = 64
LOGPROB_OPTIONS = [
    {"return_entropy": True},
    {"return_entropy": True, "temperature": 0.7, "softcap": 4.0},
    {"temperature": 1.3, "mask": True},
    {"return_entropy": True, "ignore_index": 5, "chunk_size": 4},
    {"return_entropy": True, "stats": ("is_top1", "log_sum_sq_probs", "mean_logits"), "logit_scale": 0.8,
     "softcap": 4.0, "temperature": 0.9},
    {"stats": ("mean_logits", "is_top1"), "mask": True},
]
DISTILL_OPTIONS = [
    {"beta": 0.5},
    {"beta": 0.0, "temperature": 2.0, "reduction": "sum"},
    {"beta": 1.0, "reduction": "none", "mask": True},
    {"beta": 0.2, "num_label_tokens": 9, "chunk_size": 3},
    {"beta": 0.5, "softcap": 4.0, "teacher_softcap": 2.5, "logit_scale": 1.5, "teacher_logit_scale": 0.7},
]


pool = dist_pool_fixture(4)


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str, slack: float = 1.0) -> None:
    assert got.shape == want.shape, (what, got.shape, want.shape)
    tol = (40 * ROUNDING[dtype] * slack + 1e-5) * (1 + absmax(want))
    err = (got.double() - want).abs().max().item() if got.numel() else 0.0
    assert err <= tol, f"{what}: max error {err:.3g} > {tol:.3g}"


def _check(result: tasks.TokenResult, case: TokenCase, processes: int) -> None:
    ref_outputs, ref_grads = result.reference
    assert len(result.outputs) == len(ref_outputs)
    for got, want in zip(result.outputs, ref_outputs):
        if want.dtype == torch.bool:  # is_top1: exact (seeded logits have no near-ties)
            assert got.dtype == torch.bool and torch.equal(got, want), f"is_top1 {case}"
            continue
        assert got.dtype == torch.float32
        # the hidden-state form rounds its logits in the input dtype once more
        _close(got, want, case.dtype, f"output {case}", 1.0 if case.form == "logits" else 4.0)
    assert len(result.grads) == len(ref_grads)
    for i, (got, want) in enumerate(zip(result.grads, ref_grads)):
        if want is None:  # no output got an upstream gradient
            assert got is None, f"gradient {i} {case}"
            continue
        assert got.dtype == case.dtype
        # a partial hidden gradient per process, rounded before DTensor adds them
        _close(got, want, case.dtype, f"gradient {i} {case}", 4.0 * processes)


def _statistics_bytes(case: TokenCase) -> int:
    """fp32 statistics per token: log-probs a MAX of the logsumexp, then a SUM of its mass, the
    target logit (and the entropy's mean logit; for the extra statistics: a MAX of 8 bytes for
    is_top1, a MAX and a SUM of 4 for log_sum_sq_probs, a SUM of 4 for mean_logits); distillation the same for two logsumexps, then a
    SUM of its one or two divergences."""
    if case.loss == "logprobs":
        stats = case.opts.get("stats", ())
        extra = 8 * ("log_sum_sq_probs" in stats) + 4 * ("mean_logits" in stats) + 8 * ("is_top1" in stats)
        return 4 * (1 + 2 + bool(case.opts.get("return_entropy"))) + extra
    return 4 * (2 + 2) + 4 * (1 if case.opts.get("beta", 0.5) in (0.0, 1.0) else 2)


def _cases(loss: str, form: str, mesh_dim: int, options: list[dict], **extra) -> list[TokenCase]:
    return [TokenCase(loss, form, mesh_dim, seed, (3, 7), V, dtype, opts, **extra)
            for seed, opts in enumerate(options) for dtype in (torch.float32, torch.bfloat16)]


@pytest.mark.parametrize("mesh_shape,mesh_dim", MESHES, ids=MESH_IDS)
def test_logits_sharded_over_the_vocabulary_match_fp64(pool, mesh_shape, mesh_dim):
    cases = _cases("logprobs", "logits", mesh_dim, LOGPROB_OPTIONS)
    cases += _cases("distillation", "logits", mesh_dim, DISTILL_OPTIONS, teacher_grad=True)
    cases += [TokenCase("distillation", "logits", mesh_dim, 7, (2, 5), V, torch.float32, {"beta": 0.5},
                        labels=False)]
    per_rank = [r for r in pool.run(tasks.many, mesh_shape, tasks.vocab_parallel_case, cases) if r is not None]
    assert len(per_rank) == math.prod(mesh_shape)
    for i, case in enumerate(cases):
        first = per_rank[0][i]
        _check(first, case, mesh_shape[mesh_dim])
        n_tokens = math.prod(case.batch_shape)
        for r in (ranks[i] for ranks in per_rank):
            for a, b in zip(r.outputs, first.outputs):  # replicated: the same on every process
                assert torch.equal(a, b)
            assert all(repr(p) == "Replicate()" for ps in r.output_placements for p in ps)
            assert set(r.forward_by_op) <= {"all_reduce"}, r.forward_by_op
            assert r.forward_bytes <= MAX_FORWARD_BYTES_PER_TOKEN * n_tokens, (case, r.forward_by_op)
            assert r.forward_bytes == _statistics_bytes(case) * n_tokens, (case, r.forward_by_op)
            assert r.backward_bytes == 0, (case, r.backward_by_op)
            for placements in r.grad_placements:
                assert repr(placements[mesh_dim]) == f"Shard(dim={len(case.batch_shape)})"


@pytest.mark.parametrize(
    "mesh_shape,mesh_dim,token_dim",
    [((2,), 0, None), ((3,), 0, 1), ((4,), 0, 0), ((2, 2), 1, 1)],
    ids=["2-replicate", "3-seq-parallel", "4-seq-parallel-dim0", "2x2-dim1-seq-parallel"],
)
def test_column_parallel_heads_match_fp64(pool, mesh_shape, mesh_dim, token_dim):
    cases = _cases("logprobs", "hidden", mesh_dim, LOGPROB_OPTIONS, bias=True, token_dim=token_dim)
    cases += _cases("distillation", "hidden", mesh_dim, DISTILL_OPTIONS, token_dim=token_dim, teacher_grad=True)
    cases += [TokenCase("distillation", "hidden", mesh_dim, 9, (3, 7), V, torch.float32, {"beta": 0.7}, bias=True,
                        token_dim=token_dim)]
    per_rank = [r for r in pool.run(tasks.many, mesh_shape, tasks.vocab_parallel_case, cases) if r is not None]
    hidden_placement = "Replicate()" if token_dim is None else f"Shard(dim={token_dim})"
    for i, case in enumerate(cases):
        _check(per_rank[0][i], case, mesh_shape[mesh_dim])
        n_tokens = math.prod(case.batch_shape)
        inputs = 2 if case.loss == "distillation" and case.teacher_grad else 1
        for r in (ranks[i] for ranks in per_rank):
            gathered = r.forward_by_op.get("all_gather_into_tensor", 0)
            assert (gathered > 0) == (token_dim is not None), r.forward_by_op
            assert r.forward_bytes - gathered <= MAX_FORWARD_BYTES_PER_TOKEN * n_tokens, (case, r.forward_by_op)
            # backward: only the hidden gradient's reduction, one [N, H] per input that gets one
            # (DTensor pads uneven token shards before a reduce-scatter)
            shape = case.batch_shape
            padded = n_tokens if token_dim is None else (
                n_tokens // shape[token_dim] * (-(-shape[token_dim] // mesh_shape[mesh_dim]) * mesh_shape[mesh_dim]))
            widths = [case.h] + ([case.teacher_h] if inputs == 2 else [])
            assert 0 < r.backward_bytes <= sum(padded * w * 4 for w in widths), (case, r.backward_by_op)
            head_inputs = len(r.grad_placements) // inputs
            for k, placements in enumerate(r.grad_placements):
                want = hidden_placement if k % head_inputs == 0 else "Shard(dim=0)"
                assert repr(placements[mesh_dim]) == want, (case, r.grad_placements)


def test_vocabulary_smaller_than_the_process_count(pool):
    """V = 3 over 4 processes: one shard holds no class; every statistic still combines exactly."""
    cases = [
        TokenCase("logprobs", "logits", 0, 11, (2, 3), 3, torch.float32, {"return_entropy": True}),
        TokenCase("logprobs", "hidden", 0, 12, (2, 3), 3, torch.float32, {"return_entropy": True}, bias=True),
        TokenCase("distillation", "logits", 0, 13, (2, 3), 3, torch.float32, {"beta": 0.5}, teacher_grad=True),
        TokenCase("distillation", "hidden", 0, 14, (2, 3), 3, torch.float32, {"beta": 0.0}),
    ]
    per_rank = pool.run(tasks.many, (4,), tasks.vocab_parallel_case, cases)
    for i, case in enumerate(cases):
        for r in per_rank:
            _check(r[i], case, 4)


@pytest.mark.parametrize("mesh_shape", [(2,), (4,), (2, 2)], ids=["2", "4", "2x2"])
def test_fsdp2_sharded_heads_with_plain_hidden_states(pool, mesh_shape):
    cases = [
        TokenCase("logprobs", "hidden", 0, 20, (3, 5), 37, torch.float32, {"return_entropy": True}, bias=True),
        TokenCase("logprobs", "hidden", 0, 21, (3, 5), 37, torch.bfloat16, {"temperature": 0.8}),
        TokenCase("distillation", "hidden", 0, 22, (3, 5), 37, torch.float32, {"beta": 0.5}, bias=True),
        TokenCase("distillation", "hidden", 0, 23, (3, 5), 37, torch.float32, {"beta": 0.0, "reduction": "none"},
                  teacher_grad=True),
    ]
    per_rank = [r for r in pool.run(tasks.many, mesh_shape, tasks.fsdp_case, cases) if r is not None]
    world = math.prod(mesh_shape)
    for i, case in enumerate(cases):
        for r in (ranks[i] for ranks in per_rank):
            ref_outputs, ref_grads = r["reference"]
            assert r["plain"], "each process's outputs are its own, plain tensors"
            for got, want in zip(r["outputs"], ref_outputs):
                _close(got, want, case.dtype, f"output {case}", 4.0)
            heads = [case.h] + ([case.teacher_h] if case.teacher_grad else [])
            per_head = len(ref_grads) // len(heads)
            for k, (got, want) in enumerate(zip(r["grads"], ref_grads)):
                # every process ran the same data: a parameter's gradient is the sum of world copies
                scale = 1 if k % per_head == 0 else world
                _close(got, want * scale, case.dtype, f"gradient {k} {case}", 4.0 * world)
            for placements in r["grad_placements"]:
                assert all(repr(p) == "Shard(dim=0)" for p in placements), r["grad_placements"]
            assert "reduce_scatter_tensor" in r["backward_by_op"], r["backward_by_op"]


def test_compiled_user_losses_over_dtensor_match_eager(pool):
    """The losses over DTensor inputs trace with fullgraph=True (aot_eager) and give the eager results."""
    cases = [
        TokenCase("logprobs", "logits", 0, 30, (2, 5), V, torch.float32, {"return_entropy": True, "temperature": 0.9}),
        TokenCase("distillation", "hidden", 0, 31, (2, 5), V, torch.float32, {"beta": 0.5}, token_dim=1,
                  teacher_grad=True),
    ]
    for case in cases:
        eager = pool.run(tasks.vocab_parallel_case, (2,), case)
        compiled = pool.run(tasks.vocab_parallel_case, (2,), case, "aot_eager")
        for e, c in zip(eager[:2], compiled[:2]):
            for a, b in zip(c.outputs, e.outputs):
                assert torch.allclose(a, b, rtol=1e-6, atol=1e-6), case
            for a, b in zip(c.grads, e.grads):
                assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), case
            assert c.grad_placements == e.grad_placements
            assert c.backward_bytes == e.backward_bytes


@pytest.mark.parametrize("what", ["logits placements", "one DTensor, one plain", "teacher weight placements"])
def test_student_and_teacher_must_share_one_layout(pool, what):
    for message in pool.run(tasks.mismatched_teacher, (2,), what)[:2]:
        assert message.startswith("ValueError") and "share one layout" in message, message


#: Which outputs get an upstream gradient: each alone, both, neither (log-probs, entropy).
LOGPROB_UPSTREAMS = [(0,), (1,), (0, 1), ()]
BATCH_SHAPES = [(), (5,), (2, 3), (2, 2, 2)]


def _upstream_cases(form: str, **extra) -> list[TokenCase]:
    """Every combination of upstream gradients, with and without the extra statistics, on every
    batch shape (the unbatched sample included); the upstream applied by DTensor ops on the
    outputs in every other case, on their local values otherwise."""
    cases = []
    for i, shape in enumerate(BATCH_SHAPES):
        for j, grad_to in enumerate(LOGPROB_UPSTREAMS):
            for k, opts in enumerate([{"return_entropy": True, "temperature": 0.7},
                                      {"return_entropy": True, "stats": ("is_top1", "mean_logits"), "mask": True}]):
                seed = 100 * i + 10 * j + k
                cases.append(TokenCase("logprobs", form, 0, seed, shape, V, torch.float32, opts, grad_to=grad_to,
                                       dtensor_upstream=seed % 2 == 0, **extra))
        for j, grad_to in enumerate([(0,), ()]):
            seed = 100 * i + 50 + j
            cases.append(TokenCase("distillation", form, 0, seed, shape, V, torch.float32,
                                   {"beta": 0.5, "reduction": "none" if j else "mean"}, grad_to=grad_to,
                                   teacher_grad=True, dtensor_upstream=j == 0, **extra))
    return cases


@pytest.mark.parametrize("form,sequence_parallel", [("logits", False), ("hidden", False), ("hidden", True)],
                         ids=["logits", "hidden-replicate", "hidden-seq-parallel"])
def test_any_subset_of_outputs_may_carry_the_gradient_on_any_batch_shape(pool, form, sequence_parallel):
    """An entropy bonus alone, the log-probs alone, both, or neither (and the distillation loss
    with or without a gradient), on unbatched and batched tokens, over a vocabulary sharded on
    3 processes: the fp64 reference's values and gradients; no gradient where none flowed."""
    cases = _upstream_cases(form, bias=form == "linear")
    if sequence_parallel:  # tokens sharded over their last dim; an unbatched sample has none
        cases = [dataclasses.replace(c, token_dim=len(c.batch_shape) - 1) for c in cases if c.batch_shape]
    per_rank = [r for r in pool.run(tasks.many, (3,), tasks.vocab_parallel_case, cases) if r is not None]
    assert len(per_rank) == 3
    for i, case in enumerate(cases):
        for r in (ranks[i] for ranks in per_rank):
            _check(r, case, 3)
            per_token = case.loss == "logprobs" or case.opts.get("reduction") == "none"
            assert all(o.shape == (case.batch_shape if per_token else ()) for o in r.outputs), case


def test_fsdp2_heads_any_subset_of_outputs_may_carry_the_gradient(pool):
    """The same combinations on FSDP2-sharded heads with plain hidden states (2 processes)."""
    cases = _upstream_cases("hidden")
    per_rank = [r for r in pool.run(tasks.many, (2,), tasks.fsdp_case, cases) if r is not None]
    for i, case in enumerate(cases):
        for r in (ranks[i] for ranks in per_rank):
            ref_outputs, ref_grads = r["reference"]
            for got, want in zip(r["outputs"], ref_outputs):
                if want.dtype == torch.bool:
                    assert torch.equal(got, want), case
                else:
                    _close(got, want, case.dtype, f"output {case}", 4.0)
            for k, (got, want) in enumerate(zip(r["grads"], ref_grads)):
                if want is None:
                    assert got is None, (k, case)
                    continue
                heads = 2 if case.teacher_grad else 1
                scale = 1 if k % (len(ref_grads) // heads) == 0 else 2  # a parameter's gradient: two copies
                _close(got, want * scale, case.dtype, f"gradient {k} {case}", 8.0)
