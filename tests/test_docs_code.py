"""Every ```python block of docs/**/*.md and README.md runs, or is marked as not run with the reason.

Blocks of one page run in order in one namespace (a block may use what an earlier block of the
page defined). A block right after an HTML comment ``<!-- not run: REASON -->`` is skipped with that
reason. The API pages must name every entry of each package's ``__all__``.
"""

from __future__ import annotations

import importlib
import os
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"]
FENCE = re.compile(r"^```python[^\n]*\n(.*?)^```", re.S | re.M)
NOT_RUN = re.compile(r"<!--\s*not run:\s*(.*?)\s*-->\s*$")


def blocks(page: pathlib.Path) -> list[tuple[int, str, str | None]]:
    """``(line, code, reason it is not run or None)`` of each python block of ``page``."""
    text = page.read_text()
    found = []
    for match in FENCE.finditer(text):
        before = text[: match.start()].rstrip("\n").splitlines()
        marker = NOT_RUN.search(before[-1]) if before else None
        found.append((text.count("\n", 0, match.start()) + 1, match.group(1), marker and marker.group(1)))
    return found


def _page_id(page: pathlib.Path) -> str:
    return str(page.relative_to(ROOT))


@pytest.mark.parametrize("page", [p for p in PAGES if p.exists() and blocks(p)], ids=_page_id)
def test_page_code_blocks_run(page, monkeypatch, tmp_path):
    monkeypatch.setenv("FUNCTIONAL_CE_COMPILE", "0")  # the compiled path is tested elsewhere
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    import torch

    torch.manual_seed(0)
    namespace: dict = {"__name__": f"docs_{page.stem}"}
    skipped = []
    handles = _keep_handles(monkeypatch)
    try:
        for line, code, reason in blocks(page):
            if reason:
                skipped.append(f"line {line}: {reason}")
                continue
            try:
                exec(compile(code, f"{page}:{line}", "exec"), namespace)
            except Exception as error:
                raise AssertionError(f"{_page_id(page)}, the block at line {line} failed: {error!r}") from error
    finally:
        for handle in reversed(handles):  # a page's process-wide patches end with the page
            if handle.active:
                handle.remove()
    if skipped:
        print(f"{_page_id(page)}: not run: " + "; ".join(skipped))


#: The enable functions whose patches outlive the call (a page may drop the handle, as users do).
PATCHING = ("enable_packing", "enable_linear_cross_entropy", "enable_chunked_loss", "enable_trl_heads")


def _keep_handles(monkeypatch) -> list:
    """Wrap model_patches' enable functions for one page; the handles they return, in order."""
    import model_patches

    handles: list = []
    for name in PATCHING:
        def keep(*args, _enable=getattr(model_patches, name), **kwargs):
            handle = _enable(*args, **kwargs)
            handles.append(handle)
            return handle

        monkeypatch.setattr(model_patches, name, keep)
    return handles


def test_not_run_markers_state_a_reason():
    for page in PAGES:
        if page.exists():
            for line, _, reason in blocks(page):
                assert reason is None or len(reason) > 10, f"{_page_id(page)}:{line}: say why it is not run"


@pytest.mark.parametrize("package", ["functional_ce", "model_patches", "ac_policies", "patch_layer"])
def test_api_page_names_every_public_name(package):
    text = (ROOT / "docs" / "api" / f"{package}.md").read_text()
    documented = set(re.findall(r"^::: [\w.]*?\.(\w+)$", text, re.M)) | set(re.findall(r"^- `(\w+)`", text, re.M))
    missing = sorted(set(importlib.import_module(package).__all__) - documented)
    assert not missing, f"docs/api/{package}.md lacks {missing}"


def test_docs_build_script_is_strict():
    assert "--strict" in (ROOT / ".ci" / "docs.sh").read_text()
    assert os.access(ROOT / ".ci" / "docs.sh", os.X_OK)
