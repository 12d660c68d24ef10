"""What a patch target holds now, and where Transformers' model modules are.

- :func:`is_live`: whether a wrapper is still what its target holds (a module that imported a
  wrapper while a patch was on must fall back to the original once it is removed).
- :func:`unwrapped`: the object a wrapper of this package replaced (``_packing_original``).
- :func:`model_modules`: the Transformers model modules imported in this process
  (``transformers.models.<family>.modeling_<family>``), optionally only those holding a name.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Optional

__all__ = ["is_live", "unwrapped", "model_modules"]


def is_live(target: str, wrapper: Callable) -> bool:
    """Whether ``target`` (``"module:attribute"``) holds ``wrapper`` now."""
    module_name, _, attr = target.partition(":")
    module = sys.modules.get(module_name)
    return module is not None and getattr(module, attr, None) is wrapper


def unwrapped(value: Any) -> Any:
    """The original behind a wrapper of this package, else ``value`` itself."""
    return getattr(value, "_packing_original", value)


def model_modules(holding: Optional[Callable[[dict[str, Any]], bool]] = None) -> list[str]:
    """Sorted names of the imported ``transformers.models.*.modeling_*`` modules (whose namespace
    satisfies ``holding``, when given)."""
    return sorted(
        name for name, module in list(sys.modules.items())
        if name.startswith("transformers.models.") and ".modeling_" in name and module is not None
        and (holding is None or holding(getattr(module, "__dict__", {})))
    )
