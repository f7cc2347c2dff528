"""The code's shape: no import cycles among zerotrain's modules (lazy imports count; imports only for
type checking do not), and no module outside zerotrain/families/ tests a family's name."""

from __future__ import annotations

import ast
from pathlib import Path

from zerotrain import families

PACKAGE = Path(__file__).resolve().parents[2] / "zerotrain"


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    return ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)


MODULES = {module_name(path): path for path in PACKAGE.rglob("*.py")}


def type_checking_nodes(tree: ast.AST) -> set[int]:
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(sub) for sub in ast.walk(node))
    return skipped


def imports(name: str, path: Path) -> set[str]:
    """The zerotrain modules `name` imports, at module level or inside functions."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skipped = type_checking_nodes(tree)
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("zerotrain"):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                found.add(full if full in MODULES else node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("zerotrain"))
    return {module for module in found if module in MODULES and module != name}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycles():
    graph = {name: imports(name, path) for name, path in MODULES.items()}
    assert graph["zerotrain.doctor"] and graph["zerotrain.planner.trace"], "the graph must see imports"
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def family_name_tests(tree: ast.AST, names: set[str]) -> list[tuple[int, str]]:
    """Where code tests a family's name: a comparison (==, !=, in) with one, a subscript by one, or a
    dict keyed by one (a per-family table). A catalog name that happens to equal a family's name,
    passed as an argument, is not a test."""
    def named(node: ast.AST) -> list[ast.Constant]:
        elements = node.elts if isinstance(node, ast.Tuple | ast.List | ast.Set) else [node]
        return [e for e in elements if isinstance(e, ast.Constant) and e.value in names]

    found: list[ast.Constant] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for side in (node.left, *node.comparators):
                found += named(side)
        elif isinstance(node, ast.Subscript):
            found += named(node.slice)
        elif isinstance(node, ast.Dict):
            found += [key for key in node.keys if key is not None and key in named(key)]
    return [(c.lineno, c.value) for c in found]


def test_no_module_outside_families_tests_a_family_name():
    """Outside zerotrain/families/, code asks the family (families.of(spec)) instead of comparing
    names or keeping per-family tables."""
    names = {family.name for family in families.all_families()}
    assert {"flux", "sd3", "unet"} <= names
    offenders = [f"{path.relative_to(PACKAGE.parent)}:{line} {value!r}"
                 for name, path in MODULES.items() if not name.startswith("zerotrain.families")
                 for line, value in family_name_tests(ast.parse(path.read_text(encoding="utf-8")), names)]
    assert offenders == []


def test_the_family_name_finder_finds_comparisons_lookups_and_tables():
    code = """
if spec.family == "flux": pass
if family in ("sd3", "unet"): pass
x = TABLE["flux"]
y = {"sd3": 1, "other": 2}
plan(["--model", "flux"])
"""
    assert family_name_tests(ast.parse(code), {"flux", "sd3", "unet"}) == [
        (2, "flux"), (3, "sd3"), (3, "unet"), (4, "flux"), (5, "sd3")]


def test_every_family_module_defines_one_family():
    modules = sorted(p.stem for p in (PACKAGE / "families").glob("*.py") if p.stem not in ("__init__", "base"))
    assert [type(f).__module__.rsplit(".", 1)[1] for f in families.all_families()] == modules
    for family in families.all_families():
        assert family.denoiser_classes and families.by_class(family.denoiser_classes[0]) is family
