"""Op-level (selective) checkpointing: which op outputs to keep, as data.

Inside a ``selective`` region, torch's selective-checkpoint policy keeps the outputs of the
listed ops for backward and recomputes every other op (pointwise ops, norms' arithmetic,
reshapes). The default list keeps matmuls, attention kernels and ``topk`` (routing decisions:
a recompute that reran ``topk`` on slightly different inputs could pick other experts). The
region gets a private copy of ``topk``'s values (the saved output stays intact when a router
normalises its weights in place, as Mixtral, Qwen3-MoE and OLMoE do).

Op names, any kind a selective-checkpoint policy sees:

- ``"mm"`` or ``"aten.mm"``: every overload of ``torch.ops.aten.mm``;
- ``"aten.max.default"``: that overload only (``max`` over all elements, not ``max.dim``);
- ``"_c10d_functional.all_to_all_single"``, ``"_c10d_functional.reduce_scatter_tensor"``:
  functional collectives (any ``torch.ops`` namespace works the same way);
- ``"higher_order.flex_attention"``: higher-order ops (``torch.ops.higher_order``);
- ``"deepep.dispatch.default?"``: a trailing ``?`` marks an op from an optional extension or a
  newer torch; it is saved where it is registered and skipped where it is not (looked up again
  on each region call until found).

Besides the save list, a rule can say (all plain data):

- ``recompute_every = {"k": 2, "ops": ["mm"]}``: calls of these ops are counted in each region
  (forward and recompute separately) and every k-th call is recomputed even if listed;
- ``recompute_matmuls_of = ["*.mlp.gate"]``: matmuls (``mm``, ``addmm``, and ``linear`` where a
  backend keeps it whole) whose weight operand is a weight of a module matching these globs
  (compared by shape) are always recomputed and not counted (resolved to shapes at plan time; a
  same-shaped weight elsewhere in the region matches too, as in torchtitan, whose rule this is;
  torchtitan looks at ``mm`` and ``linear`` only, its routers having no bias);
- ``save_matmuls_of``: the same, always saved (keep the router in a recomputed block);
- ``save_copies_to_cpu_from = ["cuda"]``: ``aten._to_copy`` calls moving a tensor from these
  device types to the CPU (the ``device`` keyword is ``cpu``) are always saved, ahead of every
  other choice, so a recompute never repeats a device-to-host copy (torchtitan's rule).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import re
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

__all__ = ["DEFAULT_SAVE_OPS", "Every", "resolve_ops", "selective_context_fn", "SelectiveOps"]

_OP_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*){0,2}\??$")

# aten op names (``torch.ops.aten.<name>``); any overload of a listed op is saved.
# ``_grouped_mm`` is left out on purpose: Hugging Face's grouped-experts path adds the bias to
# its output in place, which a saved (cached) output cannot allow; add it to a rule's ``ops``
# for expert code that does not mutate it.
DEFAULT_SAVE_OPS: tuple[str, ...] = (
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "topk",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable",
)
# op -> (index of the weight operand, whether it is the weight itself rather than ``weight.t()``)
_MATMULS = {"mm": (1, False), "addmm": (2, False), "linear": (1, True)}


@dataclasses.dataclass(frozen=True)
class Every:
    """Recompute every ``k``-th call (1-based, counted per region and phase) of ``ops``."""

    k: int
    ops: tuple[str, ...] = ("mm",)

    def __post_init__(self) -> None:
        if not isinstance(self.k, int) or isinstance(self.k, bool) or self.k < 1:
            raise ValueError(f"recompute_every needs k, a positive int (2: every second call), got {self.k!r}")
        if isinstance(self.ops, str) or not self.ops or not all(isinstance(o, str) for o in self.ops):
            raise TypeError(f"recompute_every.ops must be a non-empty list of op names like ['mm'], got {self.ops!r}")
        object.__setattr__(self, "ops", tuple(self.ops))
        resolve_ops(self.ops)

    @classmethod
    def from_value(cls, value: Any) -> "Every":
        if isinstance(value, Every):
            return value
        if isinstance(value, dict) and set(value) <= {"k", "ops"} and "k" in value:
            return cls(value["k"], tuple(value.get("ops", ("mm",))))
        raise TypeError(f"recompute_every is a dict like {{'k': 2, 'ops': ['mm']}}, got {value!r}")

    def to_dict(self) -> dict[str, Any]:
        return {"k": self.k, "ops": list(self.ops)}


def _resolve_one(name: str) -> Any:
    if not isinstance(name, str) or not _OP_NAME.match(name):
        raise ValueError(
            f"a selective op name looks like 'mm', 'aten.max.default', '_c10d_functional.all_to_all_single', "
            f"'higher_order.flex_attention' or, for an op that may be absent, 'deepep.dispatch.default?', got {name!r}"
        )
    parts = name.rstrip("?").split(".")
    ns, rest = ("aten", parts) if len(parts) == 1 else (parts[0], parts[1:])

    def lookup() -> Any:
        try:
            op = getattr(getattr(torch.ops, ns), rest[0])
            return getattr(op, rest[1]) if len(rest) > 1 else op
        except (AttributeError, RuntimeError):
            return None

    found = lookup()
    if found is None and ns in ("_c10d_functional", "c10d_functional"):
        try:  # registers the functional collectives where importing torch did not
            importlib.import_module("torch.distributed._functional_collectives")
        except Exception:  # noqa: BLE001 - a build without torch.distributed: unknown op below
            return None
        found = lookup()
    return found


_RESOLVED: dict[tuple[str, ...], frozenset] = {}
_FOUND: dict[str, Any] = {}


def resolve_ops(names: tuple[str, ...]) -> frozenset:
    """Op packets, overloads or higher-order ops for ``names``.

    Names ending in ``?`` and default op names missing from an older torch build are skipped;
    any other unknown name raises ValueError. A result is cached once nothing optional is
    missing, so an extension registering its ops later is still picked up.
    """
    cached = _RESOLVED.get(names)
    if cached is not None:
        return cached
    found, unknown, missing = [], [], False
    for name in names:
        op = _FOUND.get(name) or _resolve_one(name)
        if op is not None:
            _FOUND[name] = op
            found.append(op)
        elif name.endswith("?"):
            missing = True
        elif name not in DEFAULT_SAVE_OPS:  # defaults absent from older builds are fine
            unknown.append(name)
    if unknown:
        raise ValueError(
            f"unknown ops {unknown} in a selective rule (torch {torch.__version__}); use names of torch.ops: "
            "'mm' (aten), 'aten.max.default' (one overload), '_c10d_functional.all_to_all_single', "
            "'higher_order.flex_attention', or end a name with '?' for an op that may be absent"
        )
    ops = frozenset(found)
    if not missing and len(_RESOLVED) < 256:
        _RESOLVED[names] = ops
    return ops


@dataclasses.dataclass(frozen=True)
class SelectiveOps:
    """What a ``selective`` region saves, resolved for one plan row (weights become shapes)."""

    save: tuple[str, ...] = DEFAULT_SAVE_OPS
    every: Optional[Every] = None
    recompute_shapes: frozenset = frozenset()
    save_shapes: frozenset = frozenset()
    copies_to_cpu_from: frozenset = frozenset()


def _member(op: Any, ops: frozenset) -> bool:
    return op in ops or getattr(op, "overloadpacket", None) in ops


def _weight_shape(op: Any, args: tuple) -> Optional[tuple]:
    """The transposed weight's shape, ``(in, out)``, of ``mm`` / ``addmm`` (as F.linear lowers) or
    ``linear``, else None."""
    packet = getattr(op, "overloadpacket", None)
    for name, (index, whole) in _MATMULS.items():
        if packet is getattr(torch.ops.aten, name) and len(args) > index and isinstance(args[index], torch.Tensor):
            shape = tuple(args[index].shape)
            return shape[::-1] if whole else shape
    return None


def _copy_to_cpu(op: Any, args: tuple, kwargs: dict, sources: frozenset) -> bool:
    """Whether ``op`` is an ``aten._to_copy`` to the CPU of a tensor on one of ``sources``."""
    if op is not torch.ops.aten._to_copy.default or not args or "device" not in kwargs:
        return False
    device = getattr(args[0], "device", None)
    return device is not None and device.type in sources and str(kwargs["device"]) == "cpu"


def make_policy(spec: SelectiveOps) -> Callable[..., CheckpointPolicy]:
    """A fresh policy function (its own call counters) for one region's forward and recompute."""
    save = resolve_ops(tuple(spec.save))
    every_ops = resolve_ops(spec.every.ops) if spec.every is not None else frozenset()
    counts = {False: 0, True: 0}

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        if spec.copies_to_cpu_from and _copy_to_cpu(op, args, kwargs, spec.copies_to_cpu_from):
            return CheckpointPolicy.MUST_SAVE
        if spec.recompute_shapes or spec.save_shapes:
            shape = _weight_shape(op, args)
            if shape is not None and shape in spec.recompute_shapes:
                return CheckpointPolicy.PREFER_RECOMPUTE
            if shape is not None and shape in spec.save_shapes:
                return CheckpointPolicy.MUST_SAVE
        kth = False
        if spec.every is not None and _member(op, every_ops):
            counts[ctx.is_recompute] += 1
            kth = counts[ctx.is_recompute] % spec.every.k == 0
        return CheckpointPolicy.MUST_SAVE if _member(op, save) and not kth else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def selective_context_fn(spec: "SelectiveOps | Iterable[str]") -> Callable[[], tuple]:
    """A ``context_fn`` for ``torch.utils.checkpoint.checkpoint``: ``spec``'s choices, fresh counters per call."""
    if not isinstance(spec, SelectiveOps):
        spec = SelectiveOps(save=tuple(spec))
    resolve_ops(tuple(spec.save))

    def context_fn() -> tuple:
        fwd, recompute = create_selective_checkpoint_contexts(make_policy(spec))
        if torch.compiler.is_compiling():  # compiled graphs are functional: no aliasing to guard
            return fwd, recompute
        return _with_private_copies(fwd), recompute  # the recompute consumes each cached output once

    return context_fn


class _PrivateCopies(TorchDispatchMode):
    """Hands the region a copy of ``topk``'s values, so in-place edits leave the saved output intact.

    Routers commonly normalise their top-k weights in place (``values /= values.sum(-1)``);
    selective checkpointing refuses a saved output that was mutated. Inside the mode stack this
    runs above the selective-checkpoint mode, below autograd, so in forward the copy is what
    ``topk`` returns to the model and the saved output stays untouched; the recompute may then
    edit the cached output itself, which it consumes once.
    """

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket is torch.ops.aten.topk and isinstance(out, tuple):
            return (out[0].clone(),) + tuple(out[1:])
        return out


@contextlib.contextmanager
def _with_private_copies(sac_mode: Any) -> Iterator[None]:
    with sac_mode, _PrivateCopies():
        yield
