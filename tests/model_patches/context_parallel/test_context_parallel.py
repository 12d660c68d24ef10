"""``model_patches.enable_context_parallel``: packed documents with the sequence sharded over 2 and
4 gloo processes (one process group of 4 for the module), trained through sdpa and eager.

After 3 optimizer steps the losses and gradients equal one process's on the same batches (1e-5
relative; Llama, Qwen3-MoE with its load-balancing loss, sliding windows of Mistral, Gemma 2 and
Gemma 3); changing one document that spans every process leaves every other document's logits
unchanged on every rank (bitwise, within 1e-6 for MoE); attention work per process is even on packed batches; what
cannot be kept correct is refused with the setting to change."""

from __future__ import annotations

import pytest
import torch

from bench.harness.dist_pool import dist_pool_fixture
from model_patches.context_parallel import DocumentLayout, document_ids, pairs_per_rank
from tests.model_patches.context_parallel import workers

pool = dist_pool_fixture(4)


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """Within 1e-5 relative, as a whole: ``|a - b| <= 1e-5 |b|`` (Frobenius norms). Sharding changes
    the order of the sums (attention over gathered keys, the loss over pieces), so single entries
    near zero differ by round-off relative to themselves."""
    error = float((a - b).norm() / b.norm().clamp(min=1e-30))
    assert error <= 1e-5, f"{what}: relative error {error:.2e}"


def _same_losses_and_gradients(r: dict, rank: int) -> None:
    reference, sharded = r["losses"]
    torch.testing.assert_close(sharded, reference, rtol=1e-5, atol=1e-6)
    grads_ref, grads_cp = r["grads"]
    assert grads_ref.keys() == grads_cp.keys()
    for name in grads_ref:
        _close(grads_cp[name], grads_ref[name], f"rank {rank}: gradient of {name}")


#: Sliding windows of 16 tokens on rows of 100 (documents of median 24): windows cut inside documents.
WINDOW = {"sliding_window": 16}


@pytest.mark.parametrize("family, world, attention, linear_loss, router_loss, config, policy", [
    ("llama", 2, "sdpa", False, False, {}, None), ("llama", 2, "eager", False, False, {}, None),
    ("llama", 4, "sdpa", False, False, {}, None), ("llama", 2, "sdpa", True, False, {}, None),
    ("qwen3_moe", 4, "sdpa", False, True, {}, None),
    ("mistral", 4, "sdpa", False, False, WINDOW, None),   # every layer windowed
    # windowed and full layers, soft-capping (eager); the same window mask as Mistral's: nightly
    pytest.param("gemma2", 2, "eager", False, False, WINDOW, None, marks=pytest.mark.slow),
    pytest.param("gemma3_text", 4, "sdpa", False, False, WINDOW, None, marks=pytest.mark.slow),
    ("llama", 2, "sdpa", True, False, {}, "long_context"),  # checkpoints recompute the gathers; tiled MLPs
    pytest.param("qwen3_moe", 2, "sdpa", True, False, {}, "non_moe", marks=pytest.mark.slow),
])
def test_three_steps_equal_one_process(pool, family, world, attention, linear_loss, router_loss, config, policy):
    """Qwen3-MoE with its load-balancing loss: counted over the whole sequence on every process.
    Sliding windows: applied to positions in the whole row. Checkpointing presets on both runs."""
    runs = pool.run(workers.train_steps, (world,), family, attention, 3, 100, 0, linear_loss, router_loss, config,
                    1 << 26, policy)
    for rank, r in enumerate(runs[:world]):
        _same_losses_and_gradients(r, rank)
        weights_ref, weights_cp = r["weights"]
        for name in weights_ref:
            _close(weights_cp[name], weights_ref[name], f"rank {rank}: weight {name}")
        assert r["implementation"] == attention  # put back by remove()


def test_attention_in_blocks_of_queries_equals_one_process_and_keeps_less(pool):
    """``mask_elements`` small enough that each process's queries attend in checkpointed blocks:
    the same losses and gradients, and no ``[local, T]`` mask or score tensor kept for backward."""
    for rank, r in enumerate(pool.run(workers.train_steps, (2,), "llama", "sdpa", 3, 1024, 0, False, False, {},
                                      1000)[:2]):  # blocks of 128 (the fewest) of the 512 queries
        _same_losses_and_gradients(r, rank)
    for r in pool.run(workers.blocked_peaks, (4,), 2048, 64 * 2048):
        assert r["blocks"]["activations"] < r["whole"]["activations"]
        assert r["blocks"]["peak"] < r["whole"]["peak"]


def test_the_library_losses_over_a_shard_equal_one_process(pool):
    """Token log-probs and entropies (put back in row order), the distillation loss and
    ``enable_chunked_loss``'s loss (each process's sum over the batch's count, summed over the
    group) equal one process's on the whole rows."""
    for r in pool.run(workers.library_losses, (2,), 100)[:2]:
        for name, (sharded, whole) in r.items():
            torch.testing.assert_close(sharded, whole, rtol=1e-5, atol=1e-6, msg=name)


def test_two_accumulated_micro_batches_equal_one_process(pool):
    for rank, r in enumerate(pool.run(workers.accumulated_step, (2,), "llama", 100)[:2]):
        _same_losses_and_gradients(r, rank)


def test_fsdp2_over_data_and_context_parallel_2_by_2_equals_one_process(pool):
    for rank, r in enumerate(pool.run(workers.fsdp_cp_step, (2, 2), "llama", 100, dim_names=("dp", "cp"))):
        _same_losses_and_gradients(r, rank)


@pytest.mark.parametrize("family, world, config", [("llama", 2, {}), ("mistral", 4, WINDOW)])
def test_flash_attention_varlen_equals_one_process(pool, family, world, config):
    """FlashAttention (Transformers' kernels routed to the CPU double: per-sequence SDPA with flash's
    bottom-right causal alignment and window): each piece of a document is a varlen sequence against
    its document's keys up to it. Against one process on sdpa."""
    runs = pool.run(workers.on_cpu_flash, (world,), "train_steps", family, "sdpa", 3, 100, 0, False, False, config,
                    1 << 26, None, "flash_attention_2")
    for rank, r in enumerate(runs[:world]):
        _same_losses_and_gradients(r, rank)
        assert r["implementation"] == "flash_attention_2"
    for r in pool.run(workers.on_cpu_flash, (world,), "perturbed_document", family, "flash_attention_2", 100,
                      config)[:world]:
        assert torch.equal(r["after"][0, ~r["victim"]], r["before"][0, ~r["victim"]])


# flex attention compiles its kernel (about 50 s on 2 cores for both shapes): nightly
@pytest.mark.slow
def test_flex_attention_forward_equals_one_process_and_keeps_documents_apart(pool):
    """Flex has no backward on CPU: forward only. The local queries' ``BlockMask`` against the
    gathered keys gives the one process's logits, and another document's tokens change nothing."""
    for r in pool.run(workers.flex_forward, (2,), 100)[:2]:
        torch.testing.assert_close(r["sharded"], r["whole"], rtol=1e-5, atol=1e-5)
        others = ~r["victim"]
        assert torch.equal(r["after"][0, others], r["sharded"][0, others])
        assert not torch.equal(r["after"][0, r["victim"]], r["sharded"][0, r["victim"]])


@pytest.mark.parametrize("family, world, config", [pytest.param("llama", 2, {}, marks=pytest.mark.slow),
                                                  ("llama", 4, {}), ("qwen3_moe", 4, {}), ("mistral", 4, WINDOW)])
def test_no_document_sees_another(pool, family, world, config):
    for r in pool.run(workers.perturbed_document, (world,), family, "sdpa", 100, config)[:world]:
        others = ~r["victim"]
        assert r["victim_tokens"] >= 2 * world  # a piece on every process
        if family == "llama":  # dense: bitwise
            assert torch.equal(r["after"][0, others], r["before"][0, others])
        else:  # MoE: routing other rows may change an expert matmul's last bits
            torch.testing.assert_close(r["after"][0, others], r["before"][0, others], rtol=0, atol=1e-6)
        assert not torch.equal(r["after"][0, r["victim"]], r["before"][0, r["victim"]])


@pytest.mark.parametrize("world, policy, mask_elements", [(2, "none", None), (4, "full", None), (2, "full", 1000)])
def test_the_estimate_of_one_process_step_is_within_10_percent_of_the_measured_one(pool, world, policy,
                                                                                    mask_elements):
    """``ac_policies.estimate(..., context_parallel=P)`` traces one process's shard on fake tensors,
    without a process group, against every process's keys: what a process of a real run holds
    (also with the attention in blocks of queries, of which the estimate traces the first)."""
    for r in pool.run(workers.estimated_and_measured, (world,), policy, 1024, mask_elements)[:world]:
        assert abs(r["estimated"] - r["measured"]) <= 0.10 * r["measured"], r["text"]
        assert f"sharded over {world} processes" in r["text"]


def test_every_document_is_cut_head_tail_over_the_group():
    documents = torch.tensor([[1] * 8 + [2] * 3])
    layout = DocumentLayout.of(documents, world=2)
    # document 1 (tokens 0-7): 4 pieces of 2, rank 0 holds pieces 0 and 3, rank 1 pieces 1 and 2;
    # document 2 (tokens 8-10): pieces of 0, 1, 1, 1 tokens: rank 0 holds token 10, rank 1 8 and 9
    assert layout.index[0, 0].tolist() == [0, 1, 6, 7, 10, -1]
    assert layout.index[1, 0].tolist() == [2, 3, 4, 5, 8, 9]
    values = torch.arange(11)[None] * 10
    local = [layout.shard(values, r, fill=-1) for r in range(2)]
    assert local[0][0, -1].item() == -1  # padding
    assert torch.equal(layout.unshard(torch.cat(local, dim=1)), values)
    assert document_ids(torch.tensor([[0, 1, 2, 0, 1, 0, 5, 6]])).tolist() == [[1, 1, 1, 2, 2, 3, 4, 4]]


@pytest.mark.parametrize("world", [2, 4])
def test_attention_work_per_process_is_even_on_packed_batches(world):
    batch = workers.packed_rows(4, 4096, 100, seed=1)
    documents = document_ids(batch["position_ids"])
    work = pairs_per_rank(documents, DocumentLayout.of(documents, world))
    mean = sum(work) / world
    assert max(abs(w - mean) for w in work) <= 0.2 * mean, work


@pytest.mark.parametrize("family, overrides, match", [
    ("llama", {"attn_implementation": "paged|sdpa"}, "attn_implementation='sdpa'"),
    ("llama4_text", {}, "chunked attention"),
    ("qwen3_next", {}, "stateful_mixer"),
    ("mamba", {}, "stateful_mixer"),
    ("bloom", {}, "alibi"),
    ("llama", {"attn_implementation": "cp_sdpa"}, "remove the first handle"),
    ("qwen3_moe", {"output_router_logits": True}, "enable_packing"),  # the loss would count a shard
])
def test_what_cannot_be_kept_correct_is_refused(family, overrides, match):
    import model_patches
    from tests.support.tiny_models import tiny_ac_model

    implementation = overrides.pop("attn_implementation", None)
    model = tiny_ac_model(family, **overrides)
    if implementation:
        model.config._attn_implementation = implementation
    with pytest.raises(ValueError, match=match):
        model_patches.enable_context_parallel(model)


def test_without_a_process_group_it_says_so():
    import torch.distributed as dist

    import model_patches
    from tests.support.tiny_models import tiny_ac_model

    with pytest.raises(RuntimeError, match="init_process_group"):
        model_patches.enable_context_parallel(tiny_ac_model("llama"))
    assert not dist.is_initialized()
