"""Checkpoint regions that compile as one graph when they contain net-zero context wrappers.

The ``kernels`` package (a Transformers dependency) decorates attention classes with
``use_kernelized_func``: their ``forward`` sets a module-level context variable before the
original body and resets it afterwards. Under ``torch.compile`` that variable is a plain
attribute on a global object, and dynamo refuses any mutation of an outside object inside a
checkpoint region ("HOP: Unsafe side effect"), because eager checkpointing would replay it in
backward while a compiled graph cannot. The graph then breaks at every checkpointed module.

The set/reset pair is net-zero (the variable holds the same value before and after the
forward), and the compiled recompute never reads it, so not replaying it is safe. For a
region whose modules carry such a wrapper, :func:`call_region` traces the region with dynamo's
per-call side-effect allowance (``torch._dynamo.utils._disable_side_effect_safety_checks_for_current_subtracer``).
Every other region keeps dynamo's check: a real side effect in a checkpointed forward still
breaks the graph, and setting ``torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint
= True`` remains the user's decision. Eager execution is unchanged.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch
from torch import nn

__all__ = ["NET_ZERO_WRAPPER_MODULES", "call_region", "has_net_zero_wrapper", "side_effect_allowance"]

logger = logging.getLogger(__name__)

# Python modules whose forward wrappers only set and reset a context variable around the body.
NET_ZERO_WRAPPER_MODULES: tuple[str, ...] = ("kernels.",)


def _wrapped_by_net_zero_context(module: nn.Module) -> bool:
    fwd = getattr(type(module), "forward", None)
    # the defining module of the wrapper itself (functools.wraps copies the wrapped __module__)
    origin = getattr(fwd, "__globals__", {}).get("__name__", "") + "."
    return getattr(fwd, "__wrapped__", None) is not None and origin.startswith(NET_ZERO_WRAPPER_MODULES)


def has_net_zero_wrapper(module: nn.Module) -> bool:
    """Whether ``module`` or a descendant has a forward wrapped by a known net-zero context setter."""
    return any(_wrapped_by_net_zero_context(m) for m in module.modules())


def _allowance() -> Optional[Callable[..., Any]]:
    import torch._dynamo.utils

    return getattr(torch._dynamo.utils, "_disable_side_effect_safety_checks_for_current_subtracer", None)


def side_effect_allowance(module: nn.Module, fqn: str) -> Optional[Callable[..., Any]]:
    """The per-call allowance to trace ``module``'s region without dynamo's side-effect check, when
    the region needs it (a net-zero wrapper inside) and this torch build has it; else None.

    None for regions without a net-zero wrapper, and on torch builds that lack the allowance (the
    graph then breaks at this region, as it would without a policy; logged once here).
    """
    if not has_net_zero_wrapper(module):
        return None
    allow = _allowance()
    if allow is None:
        logger.warning(
            "ac_policies: %s contains a forward that sets a context variable (kernels' use_kernelized_func); "
            "torch %s cannot trace it inside a checkpoint region without a graph break. Set "
            "torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True to compile it whole.",
            fqn or "<root>", torch.__version__,
        )
    return allow


def call_region(allow: Optional[Callable[..., Any]], fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, through ``allow`` (from :func:`side_effect_allowance`) while compiling."""
    if allow is not None and torch.compiler.is_compiling():
        return allow(fn, *args, **kwargs)
    return fn(*args, **kwargs)
