"""Overlapped activation offloading: saved-tensor hooks that move a region's activations to host memory.

One :class:`OffloadRegion` serves one entry into a wrapped module's forward (one ``with
region.hooks():`` block). Its pack hook runs in forward for every tensor autograd saves:

- a tensor worth offloading (on the offloader's device type, a plain strided tensor of at
  least ``min_bytes`` bytes, neither a parameter or buffer nor a view of one) is copied into
  a pinned host buffer of the same shape and dtype, ``non_blocking``, on a side stream that
  first waits for the current stream, so the copy overlaps the forward's compute; an event
  marks the copy's end, and ``record_stream`` on the side stream keeps the device tensor's
  memory from being reused before the copy has read it, with no host synchronisation;
- every other tensor is kept as it is (a detached alias, no copy).

Its unpack hook runs in backward. The first unpack of region ``k`` starts bringing back, on
the side stream, every offloaded tensor of the region that backward reaches next: the live
region registered just before ``k`` in forward order (the prefetch). A tensor already brought
back is handed out after the current stream waits for its copy's event; one that is not is
copied back on the side stream and waited for the same way. Device buffers for the way back
are allocated on the current stream after the side stream has waited for it, and recorded on
the side stream, so neither direction depends on timing: every unpacked tensor equals the
packed one bit for bit.

Host copies live as long as the region, that is as long as the autograd graph holding its
tensors (a second backward with ``retain_graph=True`` copies them back again). Regions are
tracked by weak reference in forward order on an :class:`Offloader`, one per process and
device type (:func:`default_offloader`), so a freed graph's regions drop out by themselves.

An estimate on fake tensors (``ac_policies.estimate(..., device="cuda")``) cannot copy anything:
there :func:`modelled_offload` stands in for a region (:func:`modelling_offload` turns it on). Its
pack hook puts a meta-device copy in place of each tensor worth offloading (a meta tensor counts
against no device), and its unpack hook makes a device tensor of that shape again, counted while
backward uses it: host memory for what is offloaded, the copies in flight on the device.

The stream work sits behind a small interface (:class:`CudaStreams`, :class:`InlineStreams`):
``Offloader(device_type="cpu")`` runs the same bookkeeping on CPU tensors with plain
synchronous copies into separate CPU buffers, which is how the decisions and the prefetch
order are tested without a GPU.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import threading
import weakref
from typing import Any, Iterator, Optional

import torch
from torch import nn

__all__ = [
    "DEFAULT_MIN_BYTES",
    "modelled_offload",
    "modelling_offload",
    "CudaStreams",
    "InlineStreams",
    "OffloadRegion",
    "OffloadStats",
    "Offloader",
    "default_offloader",
]

logger = logging.getLogger(__name__)

#: Tensors smaller than this many bytes stay on the device: a copy each way costs more than it frees.
DEFAULT_MIN_BYTES = 16 * 1024


class CudaStreams:
    """Copies between a CUDA device and pinned host memory on one side stream per device.

    ``to_host(t)``: ``t`` on ``cuda:i`` -> (pinned CPU tensor of ``t``'s shape and dtype, event).
    ``to_device(host, device)``: pinned CPU tensor -> (tensor on ``device``, event). Both queue
    the copy on the device's side stream after it has waited for the current stream; neither
    blocks the host. ``wait(event)`` makes the current stream wait for the event.
    """

    def __init__(self, pin_memory: bool = True) -> None:
        self.pin_memory = pin_memory
        self._side: dict[int, torch.cuda.Stream] = {}

    def side(self, device: torch.device) -> torch.cuda.Stream:
        """The side stream of ``device`` (created on first use, then reused for every copy)."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        stream = self._side.get(index)
        if stream is None:
            stream = self._side[index] = torch.cuda.Stream(device=index)
        return stream

    def to_host(self, t: torch.Tensor) -> tuple[torch.Tensor, Any]:
        side = self.side(t.device)
        side.wait_stream(torch.cuda.current_stream(t.device))
        host = torch.empty_like(t, device="cpu", pin_memory=self.pin_memory)
        with torch.cuda.stream(side):
            host.copy_(t, non_blocking=True)
            event = side.record_event()
        # the caching allocator keeps t's block until the side stream's queued work is done
        t.record_stream(side)
        return host, event

    def to_device(self, host: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, Any]:
        side = self.side(device)
        current = torch.cuda.current_stream(device)
        buf = torch.empty_like(host, device=device)  # a block of the current stream, which uses it
        side.wait_stream(current)
        with torch.cuda.stream(side):
            buf.copy_(host, non_blocking=True)
            event = side.record_event()
        # a prefetched buffer freed unused must not be reused while the copy may still write it
        buf.record_stream(side)
        return buf, event

    def wait(self, event: Any, device: torch.device) -> None:
        torch.cuda.current_stream(device).wait_event(event)


class InlineStreams:
    """Synchronous stand-in for :class:`CudaStreams`: plain copies into separate CPU buffers.

    ``to_host`` returns a new CPU tensor with ``t``'s values (the "host copy"), ``to_device``
    a new tensor on ``device`` with the host copy's values; events are sequence numbers, and
    ``log`` lists ``("to_host" | "to_device" | "wait", event)`` in the order they happened.
    """

    def __init__(self) -> None:
        self.log: list[tuple[str, int]] = []
        self._count = 0

    def _event(self, kind: str) -> int:
        self._count += 1
        self.log.append((kind, self._count))
        return self._count

    def to_host(self, t: torch.Tensor) -> tuple[torch.Tensor, Any]:
        host = torch.empty_like(t, device="cpu")
        host.copy_(t)
        return host, self._event("to_host")

    def to_device(self, host: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, Any]:
        buf = torch.empty_like(host, device=device)
        buf.copy_(host)
        return buf, self._event("to_device")

    def wait(self, event: Any, device: torch.device) -> None:
        self.log.append(("wait", event))


@dataclasses.dataclass
class OffloadStats:
    """Counters of one :class:`Offloader` (all regions, since it was made or :meth:`reset`).

    ``offloaded``/``offloaded_bytes``: tensors (bytes) copied to host in forward; ``kept``:
    saved tensors left as they were (small, parameters, other devices, subclasses);
    ``prefetched``: tensors brought back ahead of their unpack; ``fetched``: tensors copied
    back at their unpack; ``prefetch_order``: region numbers (forward order, from 0) in the
    order their prefetch started.
    """

    offloaded: int = 0
    offloaded_bytes: int = 0
    kept: int = 0
    prefetched: int = 0
    fetched: int = 0
    prefetch_order: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Entry:
    """One offloaded tensor: its host copy (CPU), the device it came from, and a copy brought back early."""

    host: torch.Tensor
    device: torch.device
    to_host_event: Any
    back: Optional[torch.Tensor] = None
    back_event: Any = None


class _Ticket:
    """What autograd keeps for an offloaded tensor: its region and its place there."""

    __slots__ = ("region", "index")

    def __init__(self, region: "OffloadRegion", index: int) -> None:
        self.region = region
        self.index = index


class OffloadRegion:
    """The saved-tensor hooks of one region; see the module docstring.

    ``pack(t)`` -> a :class:`_Ticket` for an offloaded tensor, else ``t`` detached;
    ``unpack(packed)`` -> a tensor equal to the packed one on its original device. ``hooks()``
    is the ``saved_tensors_hooks`` context to run the region under. ``skip`` holds the
    ``untyped_storage().data_ptr()`` of tensors never offloaded (the module's parameters and
    buffers).
    """

    def __init__(self, offloader: "Offloader", skip: frozenset[int] = frozenset()) -> None:
        self._offloader = offloader
        self._skip = skip
        self._entries: list[_Entry] = []
        self._unpacked: set[int] = set()
        self._prefetch_started = False
        self._triggered = False
        self.number: Optional[int] = None

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """A ``saved_tensors_hooks`` context with this region's pack and unpack."""
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def offloads(self, t: torch.Tensor) -> bool:
        """Whether ``pack`` copies ``t`` to host (device type, plain strided tensor, size, not a parameter/buffer)."""
        off = self._offloader
        if t.device.type != off.device_type or t.layout != torch.strided:
            return False
        if type(t) is not torch.Tensor or isinstance(t, nn.Buffer):  # parameters, buffers, subclasses stay
            return False
        if t.numel() * t.element_size() < off.min_bytes:
            return False
        return t.untyped_storage().data_ptr() not in self._skip

    def pack(self, t: torch.Tensor) -> Any:
        off = self._offloader
        if not self.offloads(t):
            off.stats.kept += 1
            return t.detach()
        with torch.no_grad():
            host, event = off.streams.to_host(t)
        with off._lock:
            if self.number is None:
                off._register(self)
            self._entries.append(_Entry(host, t.device, event))
            off.stats.offloaded += 1
            off.stats.offloaded_bytes += t.numel() * t.element_size()
            index = len(self._entries) - 1
        return _Ticket(self, index)

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        off = self._offloader
        with off._lock:
            if not self._triggered:
                self._triggered = True
                previous = off._previous(self)
                if previous is not None:
                    previous._prefetch()
            entry = self._entries[packed.index]
            buf, event = entry.back, entry.back_event
            entry.back = entry.back_event = None
            self._unpacked.add(packed.index)
            if len(self._unpacked) == len(self._entries):  # every tensor back once: a later backward starts afresh
                self._unpacked.clear()
                self._triggered = self._prefetch_started = False
            if buf is None:
                off.stats.fetched += 1
        if buf is None:
            with torch.no_grad():
                buf, event = off.streams.to_device(entry.host, entry.device)
        off.streams.wait(event, entry.device)
        return buf

    def _prefetch(self) -> None:
        """Start bringing back every offloaded tensor not yet back (called under the offloader's lock)."""
        if self._prefetch_started:
            return
        self._prefetch_started = True
        off = self._offloader
        off.stats.prefetch_order.append(self.number if self.number is not None else -1)
        with torch.no_grad():
            for i, entry in enumerate(self._entries):
                if entry.back is None and i not in self._unpacked:
                    entry.back, entry.back_event = off.streams.to_device(entry.host, entry.device)
                    off.stats.prefetched += 1

    def __repr__(self) -> str:
        return f"<OffloadRegion {self.number}: {len(self._entries)} tensor(s) offloaded>"


class Offloader:
    """Regions of one device type in forward order, their copy streams and counters.

    ``device_type``: tensors of this device type are offloaded (``"cuda"``; ``"cpu"`` with
    :class:`InlineStreams` for tests). ``min_bytes``: smaller tensors stay. ``streams``: the
    copy interface (default: :class:`CudaStreams` for ``"cuda"``, else :class:`InlineStreams`).
    """

    def __init__(self, device_type: str = "cuda", min_bytes: int = DEFAULT_MIN_BYTES, streams: Optional[Any] = None) -> None:
        self.device_type = device_type
        self.min_bytes = int(min_bytes)
        self.streams = streams if streams is not None else (CudaStreams() if device_type == "cuda" else InlineStreams())
        self.stats = OffloadStats()
        self._lock = threading.RLock()
        self._order: list[weakref.ReferenceType[OffloadRegion]] = []
        self._count = 0

    def region(self, module: Optional[nn.Module] = None) -> OffloadRegion:
        """A new region; ``module``'s parameters and buffers (and views of them) are never offloaded."""
        skip: frozenset[int] = frozenset()
        if module is not None:
            skip = frozenset(
                t.untyped_storage().data_ptr()
                for t in (*module.parameters(), *module.buffers())
                if t.layout == torch.strided and type(t) in (torch.Tensor, nn.Parameter)
            )
        return OffloadRegion(self, skip)

    def _register(self, region: OffloadRegion) -> None:
        """Put ``region`` last in forward order (at its first offloaded tensor); drop regions already freed."""
        self._order = [r for r in self._order if r() is not None]
        region.number = self._count
        self._count += 1
        self._order.append(weakref.ref(region))

    def _previous(self, region: OffloadRegion) -> Optional[OffloadRegion]:
        """The live region registered just before ``region`` (the one backward reaches next), if any."""
        found: Optional[OffloadRegion] = None
        for ref in self._order:
            r = ref()
            if r is region:
                return found
            if r is not None:
                found = r
        return None

    def live_regions(self) -> list[OffloadRegion]:
        """Regions still referenced by an autograd graph, in forward order."""
        with self._lock:
            return [r for r in (ref() for ref in self._order) if r is not None]

    def reset(self) -> None:
        """Zero the counters and restart region numbers at 0."""
        with self._lock:
            self.stats = OffloadStats()
            self._count = 0


_DEFAULT: dict[str, Offloader] = {}
_DEFAULT_LOCK = threading.Lock()


def default_offloader(device_type: str = "cuda") -> Offloader:
    """The process's :class:`Offloader` for ``device_type``, which ``offload`` rules use."""
    with _DEFAULT_LOCK:
        off = _DEFAULT.get(device_type)
        if off is None:
            off = _DEFAULT[device_type] = Offloader(device_type)
            logger.info("ac_policies: offloading %s activations of %d bytes or more to host memory", device_type, off.min_bytes)
        return off


_MODELLING: contextvars.ContextVar[bool] = contextvars.ContextVar("ac_policies_modelling_offload", default=False)


@contextlib.contextmanager
def modelling_offload() -> Iterator[None]:
    """While active, ``offload`` rules run :func:`modelled_offload` (an estimate modelling a CUDA device)."""
    token = _MODELLING.set(True)
    try:
        yield
    finally:
        _MODELLING.reset(token)


def is_modelling_offload() -> bool:
    return _MODELLING.get()


def modelled_offload(module: nn.Module, min_bytes: int = DEFAULT_MIN_BYTES) -> torch.autograd.graph.saved_tensors_hooks:
    """Saved-tensor hooks that model an offload region on fake tensors (see the module docstring):
    tensors of at least ``min_bytes`` bytes, not ``module``'s parameters or buffers, leave for the
    meta device in forward and come back as new tensors in backward."""
    own = {id(t) for t in (*module.parameters(), *module.buffers())}

    def pack(t: torch.Tensor) -> Any:
        if id(t) in own or isinstance(t, nn.Parameter) or t.numel() * t.element_size() < min_bytes:
            return t.detach()
        return (t.device, t.to("meta"))

    def unpack(packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        device, host = packed
        return torch.empty_like(host, device=device)

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)
