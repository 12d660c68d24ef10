"""The signature probes of the patch records: whether a target still has the shape a replacement
was written for (None), else why not."""

from __future__ import annotations

from typing import Any, Optional, Sequence

from .arguments import MASK_PARAMETERS, parameters

__all__ = ["parameters_probe", "mask_arguments_probe"]


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
