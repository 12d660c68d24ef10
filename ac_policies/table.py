"""An ordered policy table: the first rule that matches a module decides its action."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Iterator, Optional, Sequence, Union

from torch import nn

from .rules import Rule

__all__ = ["Policy", "PolicyLike"]


@dataclasses.dataclass(frozen=True)
class Policy:
    """An ordered tuple of :class:`Rule` with an optional display name.

    Converts losslessly to and from a plain list of dicts (``to_dicts`` / ``from_dicts``) and
    JSON (``to_json`` / ``from_json``); YAML configs load into the same list of dicts.
    A table made by :func:`ac_policies.fit` also carries what was measured: ``estimates`` (one
    per rule, or None) and a ``summary`` line; they are shown by ``plan()``, not part of the
    table's data (equality, ``to_dicts``).
    """

    rules: tuple[Rule, ...]
    name: Optional[str] = None
    estimates: tuple[Any, ...] = dataclasses.field(default=(), compare=False)
    summary: str = dataclasses.field(default="", compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.rules, (str, bytes, dict)) or not isinstance(self.rules, Sequence):
            raise TypeError(f"Policy.rules must be a list of Rule or dicts, got {type(self.rules).__name__}")
        object.__setattr__(self, "rules", tuple(Rule.from_dict(r) for r in self.rules))

    def __iter__(self) -> Iterator[Rule]:
        return iter(self.rules)

    def __len__(self) -> int:
        return len(self.rules)

    def first_match(self, fqn: str, module: nn.Module) -> Optional[tuple[int, Rule]]:
        """``(index, rule)`` of the first rule matching the module, or None."""
        for i, rule in enumerate(self.rules):
            if rule.matches(fqn, module):
                return i, rule
        return None

    def to_dicts(self) -> list[dict[str, Any]]:
        """The rules as plain dicts, in order."""
        return [r.to_dict() for r in self.rules]

    @classmethod
    def from_dicts(cls, data: Sequence[Any], name: Optional[str] = None) -> "Policy":
        """Build from a list of rule dicts (or Rule objects)."""
        return cls(tuple(data), name=name)

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dicts(), **kwargs)

    @classmethod
    def from_json(cls, text: str, name: Optional[str] = None) -> "Policy":
        return cls.from_dicts(json.loads(text), name=name)

    def __str__(self) -> str:
        head = f"policy {self.name!r}" if self.name else "policy"
        head += f" ({self.summary})" if self.summary else ""
        return "\n".join([head] + [f"  {i}: {r}{self._estimate(i)}" for i, r in enumerate(self.rules)])

    def _estimate(self, index: int) -> str:
        if not self.estimates:
            return ""
        e = self.estimates[index] if index < len(self.estimates) else None
        return f"  [{e}]" if e is not None else "  [measured with the rule above]"


PolicyLike = Union[str, bool, Policy, Sequence[Union[Rule, dict]], None]
