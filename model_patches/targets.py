"""What a patch target looks like: its signature, what it holds now, and where Transformers' model
modules are.

- :func:`parameters` of a function; :func:`parameters_probe` and :func:`mask_arguments_probe`,
  the probes of the patch records (whether a target still has the shape a replacement was written
  for: None, else why not).
- :func:`is_live`: whether a wrapper is still what its target holds (a module that imported a
  wrapper while a patch was on must fall back to the original once it is removed).
- :func:`unwrapped`: the object a wrapper of this package replaced (``_packing_original``).
- :func:`model_modules`: the Transformers model modules imported in this process
  (``transformers.models.<family>.modeling_<family>``), optionally only those holding a name.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any, Callable, Collection, Optional, Sequence

__all__ = ["MASK_PARAMETERS", "parameters", "parameters_probe", "mask_arguments_probe", "is_live", "unwrapped",
           "model_modules"]

#: The first three parameters of every Transformers mask function (4.53+; ``input_embeds`` in some).
MASK_PARAMETERS = (["config", "inputs_embeds", "attention_mask"], ["config", "input_embeds", "attention_mask"])


def parameters(fn: Any) -> list[str]:
    """The parameter names of ``fn`` in order (``self`` included for a plain function)."""
    return list(inspect.signature(fn).parameters)


def parameters_probe(fn: Any, first: Sequence[str] = (), required: Sequence[str] = ()) -> Optional[str]:
    """Probe: ``fn``'s parameters start with ``first`` and include every name of ``required``
    (None), else why not (a signature that cannot be read is a reason too)."""
    try:
        params = parameters(fn)
    except (TypeError, ValueError) as exc:
        return f"cannot read its signature ({exc})"
    if params[: len(first)] != list(first):
        return f"expected parameters ({', '.join(first)}, ...), found {params}"
    missing = [name for name in required if name not in params]
    if missing:
        return f"no {' / '.join(repr(m) for m in missing)} parameter (found {params})"
    return None


def mask_arguments_probe(fn: Any) -> Optional[str]:
    """Probe: ``fn`` takes ``(config, inputs_embeds, attention_mask, ...)`` (None), else why not."""
    params = parameters(fn)
    if params[:3] not in MASK_PARAMETERS:
        return f"expected parameters (config, inputs_embeds, attention_mask, ...), found {params[:3]}"
    return None


def is_live(target: str, wrapper: Callable) -> bool:
    """Whether ``target`` (``"module:attribute"``) holds ``wrapper`` now."""
    module_name, _, attr = target.partition(":")
    module = sys.modules.get(module_name)
    return module is not None and getattr(module, attr, None) is wrapper


def unwrapped(value: Any) -> Any:
    """The original behind a wrapper of this package, else ``value`` itself."""
    return getattr(value, "_packing_original", value)


def model_modules(names: Collection[str] = (), values: Optional[Collection[Any]] = None) -> list[str]:
    """Sorted names of the imported ``transformers.models.*.modeling_*`` modules; with ``names``,
    only those holding one of them whose value (unwrapped) is one of ``values``, or is callable when
    ``values`` is None."""
    def holds(namespace: dict[str, Any]) -> bool:
        found = [unwrapped(namespace[n]) for n in names if n in namespace]
        return any(callable(v) if values is None else v in values for v in found)

    return sorted(
        name for name, module in list(sys.modules.items())
        if name.startswith("transformers.models.") and ".modeling_" in name and module is not None
        and (not names or holds(getattr(module, "__dict__", {})))
    )
