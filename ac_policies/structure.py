"""Recognising module kinds by structure: the names and kinds of a module's children.

Never by model family, so stock Hugging Face models work without per-family code:

- ``moe``: a router child (``gate`` / ``router``) plus experts: an ``experts`` /
  ``local_experts`` child, or JetMoE-style parallel experts (``input_linear`` and
  ``output_linear``). A routed block directly inside an attention module is a mixture of
  attention heads (JetMoE's MoA), part of that attention, not a MoE block.
- ``attention``: a query projection plus an output projection (``q_proj``/``o_proj``, MLA's
  ``q_a_proj``, fused ``qkv``/``Wqkv``, ...), or a ``kv_proj`` plus routed query/output
  experts (JetMoE); never linear attention.
- ``linear_attention``: a causal ``Conv1d`` child plus input and output projections (gated
  delta-net, Mamba-style mixers).
- ``norm``: a normalisation layer holding only 1-D parameters.
- ``dense_mlp``: a feed-forward with two projections (``up_proj``/``down_proj``, ``fc1``/``fc2``,
  ``linear_fc1``/``linear_fc2``, ...), never a MoE block.
- ``decoder_stack``: the module holding the decoder blocks: a child ``nn.ModuleList`` whose items
  are all decoder blocks (``model.model`` of a Hugging Face causal LM).
- ``decoder_block``: a repeated block as Hugging Face checkpoints it: an instance of its
  gradient-checkpointing layer class (found by class name in the MRO, no import), or a class
  named in ``_no_split_modules`` of the model or a sub-model (vision towers included) that holds
  a mixer or feed-forward; otherwise, by structure, a module with a mixer child (or a child
  wrapping one, as DBRX's ``norm_attn_norm``) and a feed-forward child, or a list element with a
  norm and one mixer or feed-forward child (Nemotron-H's one-mixer blocks).

Ancestor-aware tests (``inside``, the MoA exclusion, ``_no_split_modules``) need the model
being planned; :func:`planning` provides it.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator, Optional

from torch import nn

__all__ = [
    "planning",
    "planning_root",
    "is_moe",
    "is_attention",
    "is_linear_attention",
    "is_norm",
    "is_dense_mlp",
    "is_decoder_block",
    "is_decoder_stack",
]

# The model being planned, and the class names its (sub-)models keep unsplit.
_ROOT: contextvars.ContextVar[Optional[tuple[nn.Module, frozenset]]] = contextvars.ContextVar("ac_policies_root", default=None)


def _no_split_names(root: nn.Module) -> frozenset:
    names: set[str] = set()
    for m in root.modules():
        value = getattr(m, "_no_split_modules", None)
        if isinstance(value, (list, tuple, set, frozenset)):
            names.update(v for v in value if isinstance(v, str))
    return frozenset(names)


@contextlib.contextmanager
def planning(root: nn.Module) -> Iterator[None]:
    """Make ``root`` the model that ancestor-aware tests look up."""
    token = _ROOT.set((root, _no_split_names(root)))
    try:
        yield
    finally:
        _ROOT.reset(token)


def planning_root() -> Optional[nn.Module]:
    """The model being planned, or None outside :func:`planning`."""
    found = _ROOT.get()
    return None if found is None else found[0]


def _parent(fqn: str) -> Optional[nn.Module]:
    root = planning_root()
    if root is None or not fqn:
        return None
    return root.get_submodule(fqn.rpartition(".")[0])


_ROUTER_NAMES = frozenset({"gate", "router"})
_EXPERTS_NAMES = frozenset({"experts", "local_experts"})
_PARALLEL_EXPERTS = ("input_linear", "output_linear")
_Q_NAMES = frozenset({"q_proj", "qkv_proj", "q_a_proj", "query_key_value", "c_attn", "Wqkv", "qkv", "query", "q"})
_OUT_NAMES = frozenset({"o_proj", "out_proj", "dense", "c_proj", "wo", "proj", "o"})
_MLP_PAIRS = (
    ("up_proj", "down_proj"),
    ("gate_up_proj", "down_proj"),
    ("fc1", "fc2"),
    ("linear_fc1", "linear_fc2"),
    ("fc_in", "fc_out"),
    ("c_fc", "c_proj"),
    ("w1", "w2"),
    ("dense_h_to_4h", "dense_4h_to_h"),
    ("wi", "wo"),
)


def _children(module: nn.Module) -> dict[str, nn.Module]:
    return dict(module.named_children())


def _routed(kids: dict[str, nn.Module]) -> bool:
    """A router child plus experts (a container of experts, or parallel expert projections)."""
    experts = bool(_EXPERTS_NAMES & kids.keys()) or all(n in kids for n in _PARALLEL_EXPERTS)
    return bool(_ROUTER_NAMES & kids.keys()) and experts


def _attention_shape(kids: dict[str, nn.Module]) -> bool:
    qo = bool(_Q_NAMES & kids.keys()) and bool(_OUT_NAMES & kids.keys())
    moa = "kv_proj" in kids and any(_routed(_children(c)) for c in kids.values())
    return qo or moa


def _linear_attention_shape(kids: dict[str, nn.Module]) -> bool:
    has_conv = any(isinstance(m, nn.Conv1d) for m in kids.values())
    has_in = any(n.startswith("in_proj") for n in kids) or bool({"q_proj", "k_proj"} <= kids.keys())
    has_out = bool({"out_proj", "o_proj"} & kids.keys())
    return has_conv and has_in and has_out


def is_moe(fqn: str, module: nn.Module) -> bool:
    if not _routed(_children(module)):
        return False
    parent = _parent(fqn)
    if parent is not None and _attention_shape(_children(parent)):
        return False  # a mixture of attention heads is part of its attention
    return True


def is_linear_attention(fqn: str, module: nn.Module) -> bool:
    return _linear_attention_shape(_children(module))


def is_attention(fqn: str, module: nn.Module) -> bool:
    kids = _children(module)
    return _attention_shape(kids) and not _linear_attention_shape(kids)


def is_norm(fqn: str, module: nn.Module) -> bool:
    if isinstance(module, (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm)):
        return True
    if "Norm" not in type(module).__name__:
        return False
    if any(True for _ in module.children()):
        return False
    return all(p.dim() <= 1 for p in module.parameters(recurse=False))


def is_dense_mlp(fqn: str, module: nn.Module) -> bool:
    kids = _children(module)
    return any(a in kids and b in kids for a, b in _MLP_PAIRS) and not _routed(kids)


def _is_mixer(fqn: str, module: nn.Module) -> bool:
    return is_attention(fqn, module) or is_linear_attention(fqn, module)


def _is_ffn(fqn: str, module: nn.Module) -> bool:
    return _routed(_children(module)) or is_dense_mlp(fqn, module)


def _holds_block_part(module: nn.Module) -> bool:
    return any(_is_mixer(n, m) or _is_ffn(n, m) for n, m in module.named_modules())


def _hf_checkpointing_layer(module: nn.Module) -> bool:
    return any(c.__name__ == "GradientCheckpointingLayer" for c in type(module).__mro__[1:])


def is_decoder_block(fqn: str, module: nn.Module) -> bool:
    if _hf_checkpointing_layer(module):
        return True
    found = _ROOT.get()
    if found is not None and type(module).__name__ in found[1] and _holds_block_part(module):
        return True
    kids = _children(module)
    mixer = any(_is_mixer(f"{fqn}.{n}", m) for n, m in kids.items())
    wrapped_mixer = any(_is_mixer(f"{fqn}.{n}.{g}", gm) for n, m in kids.items() for g, gm in m.named_children())
    ffn = any(_is_ffn(f"{fqn}.{n}", m) for n, m in kids.items())
    if (mixer or wrapped_mixer) and ffn:
        return True
    in_list = fqn.rpartition(".")[2].isdigit()
    parts = [n for n, m in kids.items() if _is_mixer(n, m) or _is_ffn(n, m)]
    return in_list and len(parts) == 1 and any(is_norm(n, m) for n, m in kids.items())


def is_decoder_stack(fqn: str, module: nn.Module) -> bool:
    for name, child in module.named_children():
        if isinstance(child, nn.ModuleList) and len(child):
            prefix = f"{fqn}.{name}" if fqn else name
            if all(is_decoder_block(f"{prefix}.{i}", block) for i, block in enumerate(child)):
                return True
    return False
