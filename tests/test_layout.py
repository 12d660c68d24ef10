"""Source layout rules: no module of the packages or of ``bench`` over 400 lines; no import cycle
among their modules (imports inside functions count: a deferred import that only hides a cycle is
still one); each floor imports only the floors below it; no private name imported across modules."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("functional_ce", "model_patches", "ac_policies", "patch_layer", "bench")
MAX_LINES = 400
#: Files allowed over the limit for now, each with the reason.
OVER_LIMIT: dict[str, str] = {}


def modules(root: pathlib.Path, packages=PACKAGES) -> dict[str, tuple[pathlib.Path, bool]]:
    """Dotted module name -> (file, is a package ``__init__``)."""
    found = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


def imports_of(path: pathlib.Path, name: str, is_package: bool) -> list[tuple[str, list[str], bool]]:
    """``(module, names, at module level)`` for every import statement of a file, relative ones resolved."""
    here = name if is_package else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    top = {id(n) for n in tree.body} | {id(n) for stmt in tree.body if isinstance(stmt, (ast.If, ast.Try))
                                         for n in ast.walk(stmt)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, [], id(node) in top) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")[: len(here.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.append((module, [alias.name for alias in node.names], id(node) in top))
    return found


def import_graph(found: dict[str, tuple[pathlib.Path, bool]]) -> dict[str, set[str]]:
    """Module -> the modules of ``found`` it imports (``from . import x`` names the submodule ``x``)."""
    graph = {}
    for name, (path, is_package) in found.items():
        targets: set[str] = set()
        for module, names, _ in imports_of(path, name, is_package):
            targets.update(f"{module}.{n}" if f"{module}.{n}" in found else module for n in names or [None])
        graph[name] = {t for t in targets if t in found and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_source_file_over_the_line_limit():
    over = {
        str(path.relative_to(ROOT)): n
        for path, _ in modules(ROOT).values()
        if (n := len(path.read_text().splitlines())) > MAX_LINES
        and str(path.relative_to(ROOT)) not in OVER_LIMIT
    }
    assert not over, f"split these by concept (over {MAX_LINES} lines): {over}"


def test_no_import_cycle():
    found = cycles(import_graph(modules(ROOT)))
    assert not found, f"import cycles (move the shared piece into its own module): {found}"


def test_the_checks_catch_a_violation(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("from . import b\n")
    (package / "b.py").write_text("def f():\n    from .sub.c import g\n")
    (package / "sub" / "c.py").write_text("from ..a import x\n")
    (package / "d.py").write_text("from .a import x\n")
    graph = import_graph(modules(tmp_path, ("pkg",)))
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.sub.c"]]


#: What each floor may import among the distribution's packages (``docs/design.md``, "Floors").
#: ``ac_policies`` sits beside ``model_patches``: it may import it (and Transformers) only inside a
#: function, when it runs.
MAY_IMPORT = {
    "patch_layer": {"patch_layer"},
    "functional_ce": {"functional_ce"},
    "model_patches": {"model_patches", "functional_ce", "patch_layer"},
    "ac_policies": {"ac_policies", "functional_ce", "patch_layer"},
    "bench": {"bench", "functional_ce", "model_patches", "ac_policies", "patch_layer"},
}
LATE_ONLY = {"ac_policies": {"model_patches", "transformers"}}
OURS = set(MAY_IMPORT) | {"tests"}


def floor_violations(root: pathlib.Path) -> list[str]:
    bad = []
    for name, (path, is_package) in modules(root, tuple(MAY_IMPORT)).items():
        package = name.split(".")[0]
        for module, _, at_top in imports_of(path, name, is_package):
            target = module.split(".")[0]
            if target in OURS and target not in MAY_IMPORT[package]:
                if not (target in LATE_ONLY.get(package, ()) and not at_top):
                    bad.append(f"{name} imports {module}")
            elif target in LATE_ONLY.get(package, ()) and at_top:
                bad.append(f"{name} imports {module} at module level")
    return bad


def private_imports(root: pathlib.Path) -> list[str]:
    found = modules(root, tuple(MAY_IMPORT))
    bad = []
    for name, (path, is_package) in found.items():
        for module, names, _ in imports_of(path, name, is_package):
            if module.split(".")[0] not in OURS:
                continue
            bad += [f"{name} imports {module}.{n}" for n in names
                    if n.startswith("_") and not n.startswith("__") and f"{module}.{n}" not in found]
    return bad


def test_each_floor_imports_only_the_floors_below_it():
    bad = floor_violations(ROOT)
    assert not bad, f"imports across the floors of docs/design.md: {bad}"


def test_no_private_name_is_imported_across_modules():
    bad = private_imports(ROOT)
    assert not bad, f"private names imported from another module (make them public or move them): {bad}"


def test_the_floor_checks_catch_a_violation(tmp_path):
    (tmp_path / "ac_policies").mkdir()
    (tmp_path / "ac_policies" / "__init__.py").write_text("")
    (tmp_path / "ac_policies" / "a.py").write_text(
        "import transformers\nfrom model_patches import x\nfrom .b import _hidden\n\ndef f():\n    import model_patches\n")
    (tmp_path / "ac_policies" / "b.py").write_text("_hidden = 1\n")
    (tmp_path / "functional_ce").mkdir()
    (tmp_path / "functional_ce" / "c.py").write_text("from patch_layer import Handle\n")
    assert sorted(floor_violations(tmp_path)) == [
        "ac_policies.a imports model_patches", "ac_policies.a imports transformers at module level",
        "functional_ce.c imports patch_layer"]
    assert private_imports(tmp_path) == ["ac_policies.a imports ac_policies.b._hidden"]
