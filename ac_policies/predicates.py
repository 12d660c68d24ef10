"""Structural predicates over modules: one signature, ``(fqn, module) -> bool``.

A :class:`Predicate` is a named callable with an optional config form (``spec``), so that a
table using it prints readably (``moe | inside(moe)``) and converts to and from plain data.
Built-in predicates recognise modules by *structure* (see :mod:`ac_policies.structure`):
``moe``, ``attention``, ``linear_attention``, ``norm``, ``dense_mlp``, ``decoder_block``,
``decoder_stack``.

Parameterised predicates: ``layers(start, stop)`` (the first integer component of the name,
``start <= i < stop``) and ``inside(pred)`` (some strict ancestor satisfies ``pred``). Combine
with :func:`all_of`, :func:`any_of`, :func:`not_` or the operators ``&``, ``|``, ``~``.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

from torch import nn

from .structure import (
    is_attention,
    is_decoder_block,
    is_decoder_stack,
    is_dense_mlp,
    is_linear_attention,
    is_moe,
    is_norm,
    planning_root,
)

__all__ = [
    "Predicate",
    "all_of",
    "any_of",
    "not_",
    "layers",
    "inside",
    "predicate",
    "register_predicate",
    "resolve_predicate",
    "NAMED_PREDICATES",
]

PredicateFn = Callable[[str, nn.Module], bool]
Spec = Union[str, dict]

class Predicate:
    """A named ``(fqn, module) -> bool`` test with an optional config form.

    ``spec`` is the plain-data form (``"moe"``, ``{"all_of": [...]}``); ``None`` for a Python
    function that has no config form (see :func:`register_predicate`).
    """

    __slots__ = ("name", "spec", "_fn")

    def __init__(self, fn: PredicateFn, name: str, spec: Optional[Spec]) -> None:
        if not callable(fn):
            raise TypeError(f"a predicate must be callable as (fqn, module) -> bool, got {type(fn).__name__}")
        self._fn = fn
        self.name = name
        self.spec = spec

    def __call__(self, fqn: str, module: nn.Module) -> bool:
        return bool(self._fn(fqn, module))

    def __and__(self, other: Any) -> "Predicate":
        return all_of(self, other)

    def __or__(self, other: Any) -> "Predicate":
        return any_of(self, other)

    def __invert__(self) -> "Predicate":
        return not_(self)

    def __repr__(self) -> str:
        return self.name

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Predicate):
            return NotImplemented
        if self.spec is not None or other.spec is not None:
            return self.spec == other.spec
        return self._fn is other._fn

    def __hash__(self) -> int:
        return hash(repr(self.spec)) if self.spec is not None else hash(self._fn)

    def __deepcopy__(self, memo: dict) -> "Predicate":
        return self  # immutable: a copied table or policy shares its predicates

    def __reduce__(self) -> Any:
        # the config form, rebuilt where it is loaded (built-in and combined predicates); a registered
        # name is registered again with its function; a Python function without a name pickles as itself
        if isinstance(self.spec, str) and self.spec not in _BUILTIN:
            return register_predicate, (self.spec, self._fn)
        if self.spec is not None:
            return resolve_predicate, (self.spec,)
        return Predicate, (self._fn, self.name, None)


def predicate(fn: PredicateFn, name: Optional[str] = None) -> Predicate:
    """Wrap any ``(fqn, module) -> bool`` callable; it prints as ``name`` (default: its ``__name__``)."""
    if isinstance(fn, Predicate):
        return fn
    if not callable(fn):
        raise TypeError(f"expected a callable (fqn, module) -> bool, got {type(fn).__name__}: {fn!r}")
    label = name or getattr(fn, "__name__", None) or type(fn).__name__
    for named, p in NAMED_PREDICATES.items():  # registered functions keep their config form
        if p._fn is fn:
            return p
    return Predicate(fn, label, None)


def parenthesized(p: Predicate, ops: tuple[str, ...] = (" & ", " | ")) -> str:
    """The name, parenthesised when it has one of ``ops`` at the top level."""
    depth = 0
    for i, ch in enumerate(p.name):
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0 and p.name[i : i + 3] in ops:
            return f"({p.name})"
    return p.name


def all_of(*preds: Any) -> Predicate:
    """True when every predicate is true (``a & b``). Needs at least one predicate."""
    ps = [resolve_predicate(p) for p in preds]
    if not ps:
        raise ValueError("all_of() needs at least one predicate, got none")
    if len(ps) == 1:
        return ps[0]
    spec = {"all_of": [p.spec for p in ps]} if all(p.spec is not None for p in ps) else None
    return Predicate(lambda f, m: all(p(f, m) for p in ps), " & ".join(parenthesized(p, (" | ",)) for p in ps), spec)


def any_of(*preds: Any) -> Predicate:
    """True when some predicate is true (``a | b``). Needs at least one predicate."""
    ps = [resolve_predicate(p) for p in preds]
    if not ps:
        raise ValueError("any_of() needs at least one predicate, got none")
    if len(ps) == 1:
        return ps[0]
    spec = {"any_of": [p.spec for p in ps]} if all(p.spec is not None for p in ps) else None
    return Predicate(lambda f, m: any(p(f, m) for p in ps), " | ".join(parenthesized(p) for p in ps), spec)


def not_(pred: Any) -> Predicate:
    """Negation (``~a``)."""
    p = resolve_predicate(pred)
    spec = {"not": p.spec} if p.spec is not None else None
    return Predicate(lambda f, m: not p(f, m), f"~{parenthesized(p)}", spec)


def _layer_index(fqn: str) -> Optional[int]:
    for part in fqn.split("."):
        if part.isdigit():
            return int(part)
    return None


def layers(start: int = 0, stop: Optional[int] = None, step: int = 1) -> Predicate:
    """Modules whose first integer name component ``i`` is in ``range(start, stop, step)`` (``stop=None``: no end).

    ``model.layers.3.mlp`` has layer index 3; names without an integer component never match.
    ``layers(0, None, 2)`` is every second layer from the first (what torchtitan calls a
    checkpointing frequency of 2).
    """
    for label, v in (("start", start), ("stop", stop)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
            raise TypeError(f"layers({label}=...) must be a non-negative int or None, got {v!r}")
    if not isinstance(step, int) or isinstance(step, bool) or step < 1:
        raise ValueError(f"layers(step=...) must be a positive int (1: every layer, 2: every second), got {step!r}")
    if stop is not None and stop <= start:
        raise ValueError(f"layers(start, stop) needs start < stop, got start={start}, stop={stop}")

    def test(fqn: str, module: nn.Module) -> bool:
        i = _layer_index(fqn)
        return i is not None and i >= start and (stop is None or i < stop) and (i - start) % step == 0

    if step == 1:
        return Predicate(test, f"layers({start}, {stop})", {"layers": [start, stop]})
    return Predicate(test, f"layers({start}, {stop}, {step})", {"layers": [start, stop, step]})


def inside(pred: Any) -> Predicate:
    """True when a strict ancestor of the module (in the model being planned) satisfies ``pred``."""
    p = resolve_predicate(pred)

    def test(fqn: str, module: nn.Module) -> bool:
        root = planning_root()
        if root is None:
            raise ValueError(
                f"inside({p.name}) needs the whole model to find ancestors; evaluate it through "
                "ac_policies.plan(model, policy) or apply_policy, not on a lone module"
            )
        if not fqn:
            return False
        parts = fqn.split(".")
        for k in range(len(parts) - 1, -1, -1):
            prefix = ".".join(parts[:k])
            if p(prefix, root.get_submodule(prefix)):
                return True
        return False

    spec = {"inside": p.spec} if p.spec is not None else None
    return Predicate(test, f"inside({p.name})", spec)


NAMED_PREDICATES: dict[str, Predicate] = {
    "moe": Predicate(is_moe, "moe", "moe"),
    "attention": Predicate(is_attention, "attention", "attention"),
    "linear_attention": Predicate(is_linear_attention, "linear_attention", "linear_attention"),
    "norm": Predicate(is_norm, "norm", "norm"),
    "dense_mlp": Predicate(is_dense_mlp, "dense_mlp", "dense_mlp"),
    "decoder_block": Predicate(is_decoder_block, "decoder_block", "decoder_block"),
    "decoder_stack": Predicate(is_decoder_stack, "decoder_stack", "decoder_stack"),
}
_BUILTIN = frozenset(NAMED_PREDICATES)


def register_predicate(name: str, fn: PredicateFn) -> Predicate:
    """Give a Python predicate a name so tables using it convert to and from config data.

    Re-registering a name with a different function raises; built-in names cannot be replaced.
    """
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"a predicate name must be an identifier string, got {name!r}")
    if name in NAMED_PREDICATES:
        if name not in _BUILTIN and NAMED_PREDICATES[name]._fn is fn:
            return NAMED_PREDICATES[name]
        raise ValueError(f"predicate name {name!r} is already registered; choose another name")
    p = Predicate(fn, name, name)
    NAMED_PREDICATES[name] = p
    return p


def resolve_predicate(value: Any) -> Predicate:
    """A :class:`Predicate` from a name, a config dict, a Predicate or a plain callable."""
    if isinstance(value, Predicate):
        return value
    if isinstance(value, str):
        if value not in NAMED_PREDICATES:
            raise ValueError(
                f"unknown predicate {value!r}; expected one of {sorted(NAMED_PREDICATES)} "
                "(or register_predicate(name, fn) for your own)"
            )
        return NAMED_PREDICATES[value]
    if isinstance(value, dict):
        if len(value) != 1:
            raise ValueError(f"a predicate dict has exactly one key (all_of/any_of/not/layers/inside), got {value!r}")
        (key, arg), = value.items()
        if key in ("all_of", "any_of"):
            if not isinstance(arg, (list, tuple)):
                raise TypeError(f"{key} takes a list of predicates, got {arg!r}")
            return (all_of if key == "all_of" else any_of)(*arg)
        if key == "not":
            return not_(arg)
        if key == "inside":
            return inside(arg)
        if key == "layers":
            if not isinstance(arg, (list, tuple)) or len(arg) not in (2, 3):
                raise TypeError(f"layers takes [start, stop] or [start, stop, step], got {arg!r}")
            return layers(*arg)
        raise ValueError(f"unknown predicate key {key!r}; expected all_of, any_of, not, layers or inside")
    if callable(value):
        return predicate(value)
    raise TypeError(f"expected a predicate name, dict, Predicate or (fqn, module) -> bool callable, got {value!r}")
