"""The accounting engine of every memory figure in ``ac_policies``: which storages an op produces
and how many bytes of them are alive.

:class:`OpOutputs` keeps a weak reference to the storage of every tensor an op produces (each
storage once, parameters and other owned storage excluded); :class:`LiveBytes` adds the bytes
alive after each op and their maximum. :func:`~ac_policies.measure.step_bytes` and
:func:`~ac_policies.fit` measure with it on real tensors, :func:`~ac_policies.estimate` (its
:class:`~ac_policies.estimate.trace.StepTrace`) on fake ones, and the ``ac`` bench section's
timeline builds on it too.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["storage_key", "local_shard", "OpOutputs", "LiveBytes", "measured_device"]


def storage_key(t: torch.Tensor) -> int:
    """The identity of ``t``'s storage (its storage object's address): views share it, and fake
    tensors, whose storages have no data pointer, have one too. Unique while the storage lives."""
    return t.untyped_storage()._cdata


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (FSDP2 parameters and their optimizer state), else ``t``."""
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t


class OpOutputs(TorchDispatchMode):
    """Weak references to the storage of every tensor an op produces, each storage once, except
    ``owned`` storage (and, with ``device_type``, storage on other devices: host copies of
    offloaded activations do not count against a GPU's memory). ``size_of`` turns a storage's
    ``nbytes`` into the bytes counted (default: exactly ``nbytes``)."""

    def __init__(self, owned: frozenset = frozenset(), device_type: Optional[str] = None,
                 size_of: Optional[Callable[[int], int]] = None) -> None:
        super().__init__()
        self.owned = owned
        self.device_type = device_type
        self.size_of = size_of
        self.refs: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self._record(out)
        return out

    def _record(self, out: Any) -> int:
        """Record the storages in ``out``; how many were new."""
        new = 0
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            t = local_shard(t)
            if t.device.type != "meta" and (self.device_type is None or t.device.type == self.device_type):
                st = t.untyped_storage()
                key = st._cdata
                old = self.refs.get(key)
                if key not in self.owned and (old is None or old[0].expired()):
                    n = st.nbytes()
                    self.refs[key] = (StorageWeakRef(st), self.size_of(n) if self.size_of else n)
                    new += 1
        return new


def measured_device(model: nn.Module) -> Optional[str]:
    """The device type whose memory a step is measured on: the parameters' accelerator, or None
    on CPU (every tensor counts)."""
    param = next(model.parameters(), None)
    return param.device.type if param is not None and param.device.type != "cpu" else None


class LiveBytes(OpOutputs):
    """Bytes of op outputs alive after each op, and their maximum."""

    def __init__(self, owned: set, device_type: Optional[str] = None,
                 size_of: Optional[Callable[[int], int]] = None) -> None:
        super().__init__(frozenset(owned), device_type, size_of)
        self.peak = 0

    def total(self) -> int:
        for key in [k for k, (ref, _) in self.refs.items() if ref.expired()]:
            del self.refs[key]
        return sum(n for _, n in self.refs.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        self.peak = max(self.peak, self.total())
        return out
