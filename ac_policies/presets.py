"""Presets are tables, and the one place that turns user input into a :class:`Policy`.

- ``full``: every decoder block is one checkpoint region (what Hugging Face's gradient
  checkpointing does); on a MoE model this recomputes the router and experts in backward.
- ``selective``: every decoder block runs under op-level checkpointing: matmul and attention
  outputs are kept, pointwise ops are recomputed.
- ``non_moe``: attention, linear attention, norms and dense MLPs are checkpointed one submodule
  at a time; the MoE block and everything in it (router, experts, shared experts) is never
  checkpointed. Requires a MoE block.
- ``non_moe_no_attn``: as ``non_moe`` with softmax self-attention also left out (it keeps its
  activations, e.g. for fused attention kernels that are costly to rerun). Linear-attention
  mixers (gated delta-net, Mamba-style) are still checkpointed: their saved chunk states are
  large and their recompute is cheap. Requires a MoE block.
- ``op_sac``: torchtitan's op-level selective checkpointing, as data: every decoder block is
  a selective region saving :data:`TORCHTITAN_SAVE_OPS` (torch's compute-intensive ops:
  ``mm``, ``addmm``, ``bmm``, ``_scaled_mm``, convolutions, ``upsample_bilinear2d``, the
  flash/efficient attention kernels; the other SDPA kernels; ``max`` over all elements;
  ``linear``; ``topk``, so routing is never rerun; flex attention and compiled regions;
  ``reduce_scatter_tensor``, ``all_to_all_single`` and the DeepEP/HybridEP dispatch and combine
  where installed) except every second ``mm``/``linear`` of the region; always recomputing the
  MoE router's matmul (``*.mlp.gate`` and the other router names Transformers uses; not counted
  in the alternation), as torchtitan does for ``moe.router.gate``; and always saving copies
  from CUDA to the CPU. One generalisation: a router with a bias (lowered to ``addmm``) is
  recomputed too, where torchtitan, whose routers have none, matches ``mm``/``linear`` only.
- ``keep_router``: NeMo's MoE default: the whole block is recomputed except the router's
  output: its matmul (the router weights, ``*.mlp.gate`` / ``*.mlp.router`` and the like) and the ``topk`` routing
  decision are saved, so routing never changes between forward and recompute.
- ``long_context``: ``full``, plus every position-wise feed-forward tiled (``tiles="auto"``): each
  dense MLP outside a MoE block, and each MoE block (its shared experts inside it are tiled with
  it), and every norm of the blocks and after them (each keeps fp32 copies of its input for
  backward; norms inside attention or an MLP are left to them). Past a few thousand tokens the peak of a ``full`` step is one block's recompute, and
  there the MLP's ``[tokens, intermediate]`` tensors; tiled, they exist for one slice at a time
  (:mod:`ac_policies.tile`). On CUDA the decoder stack (the module holding the blocks) is under
  ``offload`` too: what the checkpointed blocks keep (each block's input) waits for backward in
  host memory, as ALST's checkpoint offload does. Off CUDA that row keeps activations where they
  are, silently (``off_cuda="ignore"``).
- ``none``: nothing is checkpointed.

Names are normalised (case, ``-``/``_``/spaces); ``True`` means ``full`` and ``False``/``None``
mean ``none``.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Mapping

from .predicates import NAMED_PREDICATES as P
from .predicates import all_of, any_of, inside, not_
from .rules import Rule
from .table import Policy, PolicyLike

__all__ = ["PRESETS", "TORCHTITAN_SAVE_OPS", "resolve_policy", "normalise_name"]

_in_moe = any_of(P["moe"], inside(P["moe"]))
_mixer = any_of(P["attention"], P["linear_attention"])
# norms of the block itself: not those inside a mixer or a dense MLP (a vision patch merger's own
# norm), which are checkpointed with it
_block_norm = all_of(P["norm"], not_(inside(any_of(P["attention"], P["linear_attention"], P["dense_mlp"]))))

_FULL = Policy((Rule(when="decoder_block", action="checkpoint", on_unmatched="error"),), name="full")
_SELECTIVE = Policy((Rule(when="decoder_block", action="selective", on_unmatched="error"),), name="selective")
_NON_MOE = Policy(
    (
        Rule(when=_in_moe, action="none", on_unmatched="error"),
        Rule(when=_mixer, action="checkpoint"),
        Rule(when=_block_norm, action="checkpoint"),
        Rule(when="dense_mlp", action="checkpoint", on_unmatched="ignore"),
    ),
    name="non_moe",
)
_NON_MOE_NO_ATTN = Policy(
    (
        Rule(when=_in_moe, action="none", on_unmatched="error"),
        Rule(when="attention", action="none"),
        Rule(when="linear_attention", action="checkpoint", on_unmatched="ignore"),
        Rule(when=_block_norm, action="checkpoint"),
        Rule(when="dense_mlp", action="checkpoint", on_unmatched="ignore"),
    ),
    name="non_moe_no_attn",
)
_NONE = Policy((), name="none")
# a feed-forward that runs position-wise: a MoE block, or a dense MLP that is not part of one
_FEED_FORWARD = any_of(P["moe"], all_of(P["dense_mlp"], not_(inside(P["moe"]))))
# the norms of the blocks and the final norm: each keeps fp32 copies of its input for backward
_BLOCK_NORMS = _block_norm
_LONG_CONTEXT = Policy(
    (
        Rule(when="decoder_stack", action="offload", off_cuda="ignore", on_unmatched="ignore"),
        Rule(when="decoder_block", action="checkpoint", on_unmatched="error"),
        Rule(when=_FEED_FORWARD, action="tile", tiles="auto", on_unmatched="error"),
        Rule(when=_BLOCK_NORMS, action="tile", tiles="auto", on_unmatched="ignore"),
    ),
    name="long_context",
)

# torchtitan's op-level SAC save set, as read in torchtitan/distributed/activation_checkpoint.py
# (``_get_default_save_ops`` of its ``SelectiveAC`` policy class, the newest form of that file
# found; undated): torch's compute-intensive ops (``compute_intensive_ops`` of
# ``torch._functorch.partitioners.get_default_op_list()``, as of torch 2.13) plus its own list;
# ``?`` marks the ops torchtitan also skips where they are not registered.
TORCHTITAN_SAVE_OPS: tuple[str, ...] = (
    "aten.mm.default",
    "aten.addmm.default",
    "aten.bmm.default",
    "aten._scaled_mm.default",
    "aten.convolution.default",
    "aten.convolution_backward.default",
    "aten.upsample_bilinear2d.default",
    "aten._flash_attention_forward.default",
    "aten._efficient_attention_forward.default",
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_cudnn_attention.default",
    "aten._scaled_dot_product_attention_math.default",
    "aten._scaled_dot_product_fused_attention_overrideable.default",
    "aten.max.default",
    "aten.linear.default",
    "aten.topk.default",
    "higher_order.flex_attention",
    "higher_order.inductor_compiled_code?",
    "torch_attn._varlen_attn.default?",
    "_c10d_functional.reduce_scatter_tensor.default",
    "_c10d_functional.all_to_all_single.default",
    "deepep.dispatch.default?",
    "deepep.combine.default?",
    "hybridep.dispatch.default?",
    "hybridep.combine.default?",
)
# MoE routers as Hugging Face names them: Qwen/Mixtral/DeepSeek `mlp.gate`, GPT-OSS/JetMoE
# `mlp.router`, DBRX `ffn.router`, Nemotron-H `mixer.gate`, older Mixtral `block_sparse_moe.gate`
_ROUTERS = ("*.mlp.gate", "*.mlp.router", "*.ffn.router", "*.mixer.gate", "*.block_sparse_moe.gate")
_OP_SAC = Policy(
    (
        Rule(
            when="decoder_block",
            action="selective",
            ops=TORCHTITAN_SAVE_OPS,
            recompute_every={"k": 2, "ops": ["aten.mm.default", "aten.linear.default"]},
            recompute_matmuls_of=_ROUTERS,
            save_copies_to_cpu_from=("cuda",),
            on_unmatched="error",
        ),
    ),
    name="op_sac",
)
_KEEP_ROUTER = Policy(
    (Rule(when="decoder_block", action="selective", ops=("topk",), save_matmuls_of=_ROUTERS, on_unmatched="error"),),
    name="keep_router",
)

PRESETS: Mapping[str, Policy] = MappingProxyType(
    {
        "full": _FULL,
        "selective": _SELECTIVE,
        "non_moe": _NON_MOE,
        "non_moe_no_attn": _NON_MOE_NO_ATTN,
        "op_sac": _OP_SAC,
        "keep_router": _KEEP_ROUTER,
        "long_context": _LONG_CONTEXT,
        "none": _NONE,
    }
)


def normalise_name(name: str) -> str:
    """``"Non-MoE"`` -> ``"non_moe"``."""
    return "_".join(name.strip().lower().replace("-", " ").replace("_", " ").split())


def resolve_policy(policy: PolicyLike) -> Policy:
    """A :class:`Policy` from a preset name, a bool/None, a Policy or a list of rules/dicts."""
    if policy is None or policy is False:
        return _NONE
    if policy is True:
        return _FULL
    if isinstance(policy, Policy):
        return policy
    if isinstance(policy, str):
        key = normalise_name(policy)
        if key not in PRESETS:
            raise ValueError(
                f"unknown activation-checkpointing preset {policy!r}; valid presets: {sorted(PRESETS)} "
                "(or pass a table: a list of Rule or dicts)"
            )
        return PRESETS[key]
    if isinstance(policy, (list, tuple)):
        return Policy(tuple(policy))
    raise TypeError(
        f"policy must be a preset name, a bool, a Policy or a list of rules/dicts, got {type(policy).__name__}"
    )

