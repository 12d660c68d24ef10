"""A rule: which modules (a whole-name glob and a structural predicate) get which action."""

from __future__ import annotations

import dataclasses
import fnmatch
from typing import Any, Optional

from torch import nn

from .predicates import parenthesized, resolve_predicate
from .selective import Every, resolve_ops
from .tile import TILES_AUTO, Tiles, check_tiles

__all__ = ["Rule", "ACTIONS", "ON_UNMATCHED"]

# checkpoint: non-reentrant torch.utils.checkpoint with RNG state preserved.
# selective:  op-level save/recompute through torch's selective-checkpoint policy.
# offload:    run as is; on CUDA its saved activations go to pinned host memory on a side stream in
#             forward and come back ahead of their use in backward (ac_policies.offload); off CUDA
#             there is nowhere to offload to: activations are kept (as 'none'), with one warning.
# tile:       run a position-wise module (dense MLP, MoE block) over ``tiles`` slices of its tokens,
#             each a checkpoint region: forward keeps no slice's intermediates, backward recomputes one
#             slice at a time (ac_policies.tile); exact, and composes with the action of an enclosing block.
# none:       leave the module alone (stops later rules from matching it).
ACTIONS = ("checkpoint", "selective", "offload", "tile", "none")

_KEYS = (
    "match", "when", "action", "ops", "recompute_every", "recompute_matmuls_of", "save_matmuls_of",
    "save_copies_to_cpu_from", "tiles", "off_cuda", "on_unmatched",
)
_SELECTIVE_ONLY = ("ops", "recompute_every", "recompute_matmuls_of", "save_matmuls_of", "save_copies_to_cpu_from")
_LISTS = ("ops", "recompute_matmuls_of", "save_matmuls_of", "save_copies_to_cpu_from")
# what planning does when a rule matches no module of the model
ON_UNMATCHED = ("warn", "error", "ignore")
# what an ``offload`` row does on a module that is not on a CUDA device (nowhere to offload to)
OFF_CUDA = ("warn", "ignore")


@dataclasses.dataclass(frozen=True)
class Rule:
    """One row of a policy table.

    ``match``: an ``fnmatch`` glob over the *whole* fully qualified module name (case
    sensitive; ``*`` also crosses dots, so ``model.layers.*.mlp`` matches ``model.layers.3.mlp``
    but never ``model.layers.3.mlp_norm``). ``when``: an optional structural predicate (a name
    such as ``"moe"``, a config dict, a :class:`Predicate` or any ``(fqn, module) -> bool``).
    ``action``: one of :data:`ACTIONS`. ``selective`` rules also take (see
    :mod:`ac_policies.selective`): ``ops``, the op names whose outputs are saved (aten,
    functional collectives, higher-order ops; ``None``:
    :data:`~ac_policies.selective.DEFAULT_SAVE_OPS`); ``recompute_every``, ``{"k": 2, "ops":
    ["mm"]}`` to recompute every k-th call of those ops; ``recompute_matmuls_of`` and
    ``save_matmuls_of``, module globs whose weights' matmuls are always recomputed or always
    saved (resolved at plan time); ``save_copies_to_cpu_from``, device types (``["cuda"]``) whose
    copies to the CPU are always saved. ``tile`` rules take ``tiles``: the number of slices of the
    tokens (an int), or ``"auto"`` (the default: slices of about ``hidden`` tokens and at least 1024, see :mod:`ac_policies.tile`).
    ``offload`` rules take ``off_cuda``: what the row does where its module is not on a CUDA
    device, so there is nowhere to offload to: it always keeps the activations where they are, with
    one warning per process (``"warn"``, the default) or silently (``"ignore"``: a row meant for
    CUDA only, as in the ``long_context`` preset).
    ``on_unmatched``: what
    planning does when the rule matches no module: ``"warn"`` (default), ``"error"``
    (ValueError; how MoE-scoped presets refuse dense models) or ``"ignore"`` (for preset rows
    covering module kinds a model may lack, such as dense MLPs in an all-MoE model).
    """

    match: str = "*"
    when: Optional[Any] = None
    action: str = "checkpoint"
    ops: Optional[tuple[str, ...]] = None
    recompute_every: Optional[Every] = None
    recompute_matmuls_of: Optional[tuple[str, ...]] = None
    save_matmuls_of: Optional[tuple[str, ...]] = None
    save_copies_to_cpu_from: Optional[tuple[str, ...]] = None
    tiles: Optional[Tiles] = None
    off_cuda: str = "warn"
    on_unmatched: str = "warn"

    def __post_init__(self) -> None:
        if not isinstance(self.match, str) or not self.match:
            raise TypeError(f"Rule.match must be a non-empty glob string like 'model.layers.*', got {self.match!r}")
        if not isinstance(self.action, str) or self.action.strip().lower() not in ACTIONS:
            raise ValueError(f"Rule.action must be one of {list(ACTIONS)}, got {self.action!r}")
        object.__setattr__(self, "action", self.action.strip().lower())
        if self.when is not None:
            object.__setattr__(self, "when", resolve_predicate(self.when))
        for key in _SELECTIVE_ONLY:
            if getattr(self, key) is not None and self.action != "selective":
                raise ValueError(f"Rule.{key} only applies to action='selective', got {key} with action={self.action!r}")
        if self.tiles is not None and self.action != "tile":
            raise ValueError(f"Rule.tiles only applies to action='tile', got tiles with action={self.action!r}")
        if self.action == "tile":
            object.__setattr__(self, "tiles", check_tiles(TILES_AUTO if self.tiles is None else self.tiles))
        if self.ops is not None:
            if isinstance(self.ops, str) or not all(isinstance(o, str) for o in self.ops):
                raise TypeError(f"Rule.ops must be a list of op names like ['mm', 'topk'], got {self.ops!r}")
            object.__setattr__(self, "ops", tuple(self.ops))
            resolve_ops(self.ops)  # fail at construction, not mid-forward
        if self.recompute_every is not None:
            object.__setattr__(self, "recompute_every", Every.from_value(self.recompute_every))
        for key in ("recompute_matmuls_of", "save_matmuls_of"):
            globs = getattr(self, key)
            if globs is not None:
                if isinstance(globs, str) or not globs or not all(isinstance(g, str) and g for g in globs):
                    raise TypeError(f"Rule.{key} must be a non-empty list of module globs like ['*.mlp.gate'], got {globs!r}")
                object.__setattr__(self, key, tuple(globs))
        if self.save_copies_to_cpu_from is not None:
            kinds = self.save_copies_to_cpu_from
            if isinstance(kinds, str) or not kinds or not all(isinstance(k, str) and k.isidentifier() for k in kinds):
                raise TypeError(f"Rule.save_copies_to_cpu_from must be a non-empty list of device types like ['cuda'], got {kinds!r}")
            if "cpu" in kinds:
                raise ValueError("Rule.save_copies_to_cpu_from lists the devices copied *from*; 'cpu' is the destination")
            object.__setattr__(self, "save_copies_to_cpu_from", tuple(kinds))
        if self.off_cuda not in OFF_CUDA:
            raise ValueError(f"Rule.off_cuda must be one of {list(OFF_CUDA)}, got {self.off_cuda!r}")
        if self.off_cuda != "warn" and self.action != "offload":
            raise ValueError(f"Rule.off_cuda only applies to action='offload', got off_cuda with action={self.action!r}")
        if self.on_unmatched not in ON_UNMATCHED:
            raise ValueError(f"Rule.on_unmatched must be one of {list(ON_UNMATCHED)}, got {self.on_unmatched!r}")

    def matches(self, fqn: str, module: nn.Module) -> bool:
        """Whether this rule applies to the module called ``fqn``."""
        if not fnmatch.fnmatchcase(fqn, self.match):
            return False
        return self.when is None or self.when(fqn, module)

    def __str__(self) -> str:
        parts = [] if self.match == "*" else [f"match({self.match!r})"]
        if self.when is not None:
            parts.append(parenthesized(self.when, (" | ",)) if parts else self.when.name)
        text = " & ".join(parts) or "*"
        ops = f" ops={list(self.ops)}" if self.ops is not None else ""
        if self.recompute_every is not None:
            ops += f" recompute_every={self.recompute_every.to_dict()}"
        for key in ("recompute_matmuls_of", "save_matmuls_of", "save_copies_to_cpu_from"):
            if getattr(self, key) is not None:
                ops += f" {key}={list(getattr(self, key))}"
        if self.action == "tile":
            ops += f" tiles={self.tiles}"
        if self.off_cuda != "warn":
            ops += f" off_cuda={self.off_cuda}"
        req = "" if self.on_unmatched == "warn" else f" (if unmatched: {self.on_unmatched})"
        return f"{text} -> {self.action}{ops}{req}"

    # ---- config form ------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON/YAML-ready); raises TypeError for a predicate without a config form."""
        out: dict[str, Any] = {"match": self.match, "action": self.action}
        if self.when is not None:
            if self.when.spec is None:
                raise TypeError(
                    f"rule {self} uses the Python predicate {self.when.name!r}, which has no config form; "
                    "register it with ac_policies.register_predicate(name, fn) to serialise it by name"
                )
            out["when"] = self.when.spec
        if self.ops is not None:
            out["ops"] = list(self.ops)
        if self.recompute_every is not None:
            out["recompute_every"] = self.recompute_every.to_dict()
        for key in ("recompute_matmuls_of", "save_matmuls_of", "save_copies_to_cpu_from"):
            if getattr(self, key) is not None:
                out[key] = list(getattr(self, key))
        if self.action == "tile":
            out["tiles"] = self.tiles
        if self.off_cuda != "warn":
            out["off_cuda"] = self.off_cuda
        if self.on_unmatched != "warn":
            out["on_unmatched"] = self.on_unmatched
        return out

    @classmethod
    def from_dict(cls, data: Any) -> "Rule":
        """The inverse of :meth:`to_dict`; unknown keys raise ValueError."""
        if isinstance(data, Rule):
            return data
        if not isinstance(data, dict):
            raise TypeError(f"a rule is a dict like {{'match': 'model.layers.*', 'action': 'checkpoint'}}, got {data!r}")
        extra = set(data) - set(_KEYS)
        if extra:
            raise ValueError(f"unknown rule keys {sorted(extra)}; expected some of {list(_KEYS)}")
        kw = dict(data)
        for key in _LISTS:
            if isinstance(kw.get(key), list):
                kw[key] = tuple(kw[key])
        return cls(**kw)
