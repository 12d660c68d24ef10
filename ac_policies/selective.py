"""Op-level (selective) checkpointing: which op outputs to keep, as data.

Inside a ``selective`` region, torch's selective-checkpoint policy keeps the outputs of the
listed ops for backward and recomputes every other op (pointwise ops, norms' arithmetic,
reshapes). The default list keeps matmuls and attention kernels, the expensive ops whose
outputs are cheap to hold relative to recomputing them.
"""

from __future__ import annotations

import functools
import re
from typing import Callable, Iterable

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

__all__ = ["DEFAULT_SAVE_OPS", "resolve_ops", "selective_context_fn"]

_OP_NAME = re.compile(r"^(aten\.)?[A-Za-z_][A-Za-z0-9_]*$")

# aten op names (``torch.ops.aten.<name>``); any overload of a listed op is saved.
# ``_grouped_mm`` is left out on purpose: Hugging Face's grouped-experts path adds the bias to
# its output in place, which a saved (cached) output cannot allow; add it to a rule's ``ops``
# for expert code that does not mutate it.
DEFAULT_SAVE_OPS: tuple[str, ...] = (
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable",
)


@functools.lru_cache(maxsize=64)
def resolve_ops(names: tuple[str, ...]) -> frozenset:
    """``torch.ops.aten`` op packets for ``names``.

    Default op names missing from an older torch build are skipped; any other unknown name
    raises ValueError.
    """
    found = []
    missing = []
    for name in names:
        if not isinstance(name, str) or not _OP_NAME.match(name):
            raise ValueError(f"selective ops are aten op names like 'mm' or 'addmm', got {name!r}")
        base = name.removeprefix("aten.")
        try:
            found.append(getattr(torch.ops.aten, base))
        except AttributeError:
            missing.append(base)
    unknown = [m for m in missing if m not in DEFAULT_SAVE_OPS]  # defaults absent from older builds are fine
    if unknown:
        raise ValueError(
            f"unknown aten ops {unknown} in a selective rule (torch {torch.__version__}); "
            "use names of torch.ops.aten, e.g. 'mm', 'bmm', '_scaled_dot_product_flash_attention'"
        )
    return frozenset(found)


def selective_context_fn(ops: Iterable[str]) -> Callable[[], tuple]:
    """A ``context_fn`` for ``torch.utils.checkpoint.checkpoint`` saving ``ops``, recomputing the rest."""
    save = resolve_ops(tuple(ops))

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        packet = getattr(op, "overloadpacket", op)
        return CheckpointPolicy.MUST_SAVE if packet in save else CheckpointPolicy.PREFER_RECOMPUTE

    return functools.partial(create_selective_checkpoint_contexts, policy)
