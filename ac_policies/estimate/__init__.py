"""The memory of a training step before it runs: :func:`estimate` runs one step on fake tensors
(forward, backward, optimizer step) and returns a :class:`MemoryEstimate`;
:func:`measure_step` is the same accounting on a real step. ``python -m ac_policies.estimate
CONFIG.json ...`` does it for a Hugging Face config (see ``__main__``); :func:`longest_context`
searches the longest sequence that fits a budget (``--longest``)."""

from .api import estimate, measure_step
from .longest import ContextRow, LongestContext, longest_context, token_step
from .result import MemoryEstimate

__all__ = ["ContextRow", "LongestContext", "MemoryEstimate", "estimate", "longest_context", "measure_step", "token_step"]
