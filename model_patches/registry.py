"""A generic, version-gated table of monkey patches with reference-counted undo handles.

A :class:`PatchRecord` is data: which attribute to replace (``target``, ``"module:attr[.attr]"``),
for which Transformers releases (``versions``, a ``packaging`` specifier set), a ``probe`` that
checks the original object still has the shape the replacement was written for, and a
``build`` function that makes the replacement from the original.

:func:`apply_records` checks every record first (gate, target, probe) and only then patches,
so a failure never leaves a half-applied set. It returns a :class:`PatchHandle` that undoes
exactly what it did. Patches are reference counted per target: applying the same record twice
is a no-op, and the original comes back when the last handle is removed.

Outcomes per record:

- the gate excludes the installed release -> ``skipped`` (nothing patched, reason says why);
- the gate admits it but the target is missing or the probe returns a reason -> a
  :class:`PatchError` naming the installed version and the tested range (``strict=False``
  logs a warning instead and the record is ``failed``);
- the installed release is newer than the newest tested one -> the probes still run, and a
  warning is issued once per process.

This module knows nothing about what the patches do.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import warnings
from typing import Any, Callable, Optional, Sequence

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import Version

from patch_layer import LOCK, AttributeLedger, Handle

__all__ = [
    "PatchRecord",
    "PatchHandle",
    "PatchError",
    "StatusRow",
    "StatusTable",
    "apply_records",
    "record_status",
    "live_records",
    "is_applied",
    "installed_version",
    "package_version",
    "NEWEST_TESTED",
]

logger = logging.getLogger(__name__)

#: Newest Transformers release the records of this library were tested against. A record may
#: name its own (``PatchRecord.newest_tested``).
NEWEST_TESTED = "5.25.0"


class PatchError(RuntimeError):
    """A record admitted by its version gate cannot be applied (missing target or failed probe)."""


@dataclasses.dataclass(frozen=True)
class PatchRecord:
    """One patch, as data.

    ``probe(original) -> None`` when ``original`` has the expected shape, else a short reason.
    ``build(original) -> replacement``. ``epoch`` groups records for readers
    (``"4.53-5.3"``); ``newest_tested`` overrides :data:`NEWEST_TESTED` for this record;
    ``table`` names the table that made it (``"packing"``, ``"loss"``), for status functions;
    ``package`` the distribution whose version ``versions`` gates (``"transformers"``, ``"trl"``).
    """

    name: str
    target: str
    versions: str
    probe: Callable[[Any], Optional[str]]
    build: Callable[[Any], Any]
    epoch: str = ""
    doc: str = ""
    newest_tested: str = ""
    table: str = ""
    package: str = "transformers"

    def __post_init__(self) -> None:
        module, sep, attr = self.target.partition(":")
        if not sep or not module or not attr:
            raise ValueError(
                f"PatchRecord.target must be 'module:attribute[.attribute]', got {self.target!r}; "
                "for example 'transformers.masking_utils:_preprocess_mask_arguments'"
            )
        try:
            SpecifierSet(self.versions)
        except InvalidSpecifier as exc:
            raise ValueError(
                f"PatchRecord.versions must be a packaging specifier set such as '>=4.53,<5.4', "
                f"got {self.versions!r} ({exc})"
            ) from None
        if not callable(self.probe) or not callable(self.build):
            raise TypeError(f"PatchRecord {self.name!r}: probe and build must be callables")

    def admits(self, version: str) -> bool:
        """Whether the version gate admits ``version`` (pre-releases included)."""
        return SpecifierSet(self.versions).contains(Version(version), prereleases=True)

    def tested_range(self) -> str:
        """Human-readable tested range: the gate and the newest tested release."""
        return f"{self.package} {self.versions} (tested up to {self.newest_tested or NEWEST_TESTED})"


@dataclasses.dataclass(frozen=True)
class StatusRow:
    """One line of :func:`record_status`: ``state`` is applied / available / skipped / failed."""

    name: str
    target: str
    versions: str
    state: str
    reason: str
    epoch: str = ""


class StatusTable(list):
    """The rows of a status function (a list of :class:`StatusRow`) that prints as a table."""

    _COLUMNS = ("state", "name", "versions", "reason")

    def __str__(self) -> str:
        cells = [self._COLUMNS] + [tuple(str(getattr(r, c)) for c in self._COLUMNS) for r in self]
        widths = [min(max(len(row[i]) for row in cells), 72) for i in range(len(self._COLUMNS))]
        lines = ["  ".join(cell[:w].ljust(w) for cell, w in zip(row, widths)).rstrip() for row in cells]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)


def package_version(name: str) -> Optional[str]:
    """The imported ``name.__version__`` (a distribution some records gate on: ``"trl"``,
    ``"accelerate"``), or None when it is not installed."""
    try:
        module = importlib.import_module(name)
    except ImportError:
        return None
    return str(module.__version__)


def installed_version() -> str:
    """The imported ``transformers.__version__`` (what is really on ``sys.path``)."""
    import transformers

    return str(transformers.__version__)


#: The attributes this package's records have patched (:class:`patch_layer.AttributeLedger`).
LEDGER = AttributeLedger()
_WARNED_NEWER: set[tuple[str, str]] = set()


def _resolve(target: str) -> tuple[Any, str, Any]:
    """``"pkg.mod:a.b"`` -> (owner of ``b``, ``"b"``, current value). Raises LookupError."""
    module_name, _, path = target.partition(":")
    try:
        owner: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise LookupError(f"module {module_name!r} cannot be imported ({exc})") from None
    parts = path.split(".")
    for part in parts[:-1]:
        if not hasattr(owner, part):
            raise LookupError(f"{module_name!r} has no attribute path {path!r} (stops at {part!r})")
        owner = getattr(owner, part)
    if not hasattr(owner, parts[-1]):
        raise LookupError(f"{module_name!r} has no attribute {path!r}")
    return owner, parts[-1], getattr(owner, parts[-1])


def _original(record: PatchRecord) -> Any:
    """The unpatched object behind ``record.target`` (looks through an active patch)."""
    active = LEDGER.get(record.target)
    if active is not None:
        return active.original
    return _resolve(record.target)[2]


def _check(record: PatchRecord, version: str) -> tuple[str, str]:
    """(state, reason) for one record without patching: available / skipped / failed."""
    if not record.admits(version):
        return "skipped", f"{record.package} {version} is outside {record.versions}"
    try:
        original = _original(record)
    except LookupError as exc:
        return "failed", f"target {record.target} missing: {exc}"
    try:
        reason = record.probe(original)
    except Exception as exc:  # noqa: BLE001 - a probe that crashes is a failed probe, not a crash of the caller
        reason = f"probe raised {type(exc).__name__}: {exc}"
    if reason:
        return "failed", f"probe of {record.target} failed: {reason}"
    return "available", ""


def _warn_if_newer(records: Sequence[PatchRecord], version: str) -> None:
    for rec in records:
        newest = rec.newest_tested or NEWEST_TESTED
        if rec.admits(version) and Version(version) > Version(newest):
            key = (version, newest)
            if key not in _WARNED_NEWER:
                _WARNED_NEWER.add(key)
                msg = (
                    f"{rec.package} {version} is newer than the newest release these patches were "
                    f"tested on ({newest}); the probes passed or are being run, but check "
                    "model_patches status and run the packing tests before trusting results"
                )
                logger.warning(msg)
                warnings.warn(msg, UserWarning, stacklevel=3)


class PatchHandle(Handle):
    """Undo handle of :func:`apply_records`; also a context manager.

    ``remove()`` releases this handle's references; a target gets its original back when the
    last handle holding it is removed. Removing twice is a no-op. If something replaced a
    patched target after this handle patched it (another library wrapping the wrapper), the
    replacement is taken out from under that code when it holds the replacement in a closure
    (it then calls the original); otherwise ``remove()`` raises ``ValueError`` naming the target
    and changes nothing: putting the original back would delete that later code, which still
    calls this handle's replacement. Remove the later patch first, then this handle.
    ``companions``: other handles that belong to the same patch (hooks, guards), removed with it,
    last added first.
    """

    def __init__(self, targets: Sequence[str], rows: Sequence[StatusRow], what: str = "",
                 companions: Sequence[Handle] = ()) -> None:
        super().__init__(companions, ledger=LEDGER, targets=targets)
        self.rows: StatusTable = StatusTable(rows)  # what apply_records did, one row per record
        self._what = what

    def _describe(self) -> str:
        return f"{self._what + ': ' if self._what else ''}{len(self._targets)} patches"


def apply_records(
    records: Sequence[PatchRecord], *, strict: bool = True, version: Optional[str] = None, what: str = ""
) -> PatchHandle:
    """Apply every record whose gate and probe pass; return the undo handle.

    ``version`` overrides the detected Transformers version (for tests of the gate logic).
    ``strict`` means what it means across this library: a problem that would otherwise be a
    warning is an error. Here: with ``strict=True`` any admitted record that cannot be applied
    raises :class:`PatchError` before anything is patched; with ``strict=False`` it is logged
    as a warning and left out. ``what`` names the patches in the handle's ``repr``.
    """
    version = version or installed_version()
    with LOCK:
        _warn_if_newer(records, version)
        checks = [(rec, *_check(rec, version)) for rec in records]
        failed = [(rec, reason) for rec, state, reason in checks if state == "failed"]
        if failed:
            lines = "\n".join(f"  - {r.name}: {why} [for {r.tested_range()}]" for r, why in failed)
            package = failed[0][0].package
            msg = (
                f"{package} {version} is installed, and {len(failed)} patch record(s) admitted "
                f"by their version gate cannot be applied:\n{lines}\n"
                f"Fix: install a {package} release inside the tested range, or pass strict=False "
                "to continue without these patches (their features are then unavailable)."
            )
            if strict:
                raise PatchError(msg)
            logger.warning(msg)
        targets: list[str] = []
        rows: list[StatusRow] = []
        for rec, state, reason in checks:
            if state == "available":
                _patch(rec)
                targets.append(rec.target)
                state = "applied"
            elif state == "skipped":
                logger.debug("skipped %s: %s", rec.name, reason)
            rows.append(StatusRow(rec.name, rec.target, rec.versions, state, reason, rec.epoch))
        return PatchHandle(targets, rows, what)


def _patch(rec: PatchRecord) -> None:
    patch = LEDGER.get(rec.target)
    if patch is not None:
        if patch.source != rec:
            raise PatchError(
                f"{rec.target} is already patched by record {patch.source.name!r}; record {rec.name!r} "
                "cannot patch it too. Remove the other handle first."
            )
        LEDGER.acquire(rec.target)
        return
    owner, attr, original = _resolve(rec.target)
    LEDGER.install(rec.target, owner, attr, rec.build(original), source=rec)
    logger.info("patched %s (%s)", rec.target, rec.name)


def live_records() -> list[PatchRecord]:
    """Every record currently applied by a live handle, in the order they were applied."""
    with LOCK:
        return [patch.source for patch in LEDGER]


def is_applied(target: str) -> bool:
    """Whether ``target`` (``"module:attr[.attr]"``) currently holds a replacement applied by a live handle.

    A lock-free read (one dict lookup), so that patched code calling it at forward time traces
    under ``torch.compile`` without a graph break.
    """
    patch = LEDGER.get(target)
    return patch is not None and patch.live


def record_status(records: Sequence[PatchRecord], *, version: Optional[str] = None) -> StatusTable:
    """One row per record: applied (by a live handle), available, skipped or failed, and why."""
    version = version or installed_version()
    rows = []
    with LOCK:
        for rec in records:
            patch = LEDGER.get(rec.target)
            if patch is not None and patch.source == rec:
                state, reason = "applied", f"{patch.refcount} live handle(s)"
            else:
                state, reason = _check(rec, version)
            rows.append(StatusRow(rec.name, rec.target, rec.versions, state, reason, rec.epoch))
    return StatusTable(rows)
