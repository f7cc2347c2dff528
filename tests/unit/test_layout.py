"""The code's shape: no import cycles among zerotrain's modules, counting every import edge (lazy imports
inside functions, imports only for type checking, package __init__ files); no module outside
zerotrain/families/ tests a family's name; no family imports another; and each family's two sides import at
module level, its declarations nothing heavy and its torch side (zerotrain/families/runtime/) all it needs."""

from __future__ import annotations

import ast
from pathlib import Path

from zerotrain import families

PACKAGE = Path(__file__).resolve().parents[2] / "zerotrain"


def module_paths(root: Path, package: str) -> dict[str, Path]:
    """Every module of `package` (a folder under `root`) by dotted name; a package by its __init__."""
    found = {}
    for path in sorted((root / package.replace(".", "/")).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = module_paths(PACKAGE.parent, PACKAGE.name)


def prefixes(name: str) -> list[str]:
    """a.b.c -> a, a.b, a.b.c: importing a module first runs each enclosing package's __init__."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def imported_names(tree: ast.AST, name: str, is_package: bool, modules: dict[str, Path]) -> tuple[set[str], set[str]]:
    """(explicit, implicit) dotted names imported anywhere in the tree: at module level, inside functions
    and under `if TYPE_CHECKING:` alike. Explicit: what the statement names (a submodule named by
    `from X import Y` rather than X). Implicit: the packages X whose __init__ runs on the way.
    A package __init__ that calls import_module with a computed name discovers plug-ins: it imports
    every submodule of the package."""
    here = name if is_package else name.rpartition(".")[0]
    explicit: set[str] = set()
    implicit: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            explicit.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = here.split(".")[: len(here.split(".")) - node.level + 1] if node.level else []
            source = ".".join([*base, *([node.module] if node.module else [])])
            submodules = {f"{source}.{alias.name}" for alias in node.names} & modules.keys()
            explicit |= submodules
            (implicit if len(submodules) == len(node.names) else explicit).add(source)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module":
            argument = node.args[0] if node.args else None
            if isinstance(argument, ast.Constant) and isinstance(argument.value, str):
                explicit.add(argument.value)
            elif is_package:
                explicit.update(m for m in modules if m.rpartition(".")[0] == name)
    return explicit, implicit


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Each module of `package` -> the modules of `package` it imports. Importing a.b.c depends on a.b.c
    and on the __init__ of a and a.b, except on the importer's own enclosing packages, which Python has
    already begun before the importer runs."""
    modules = module_paths(root, package)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        explicit, implicit = imported_names(ast.parse(path.read_text(encoding="utf-8")), name, is_package, modules)
        enclosing = set(prefixes(name)) - ({name} if not is_package else set())
        edges = {target for target in explicit if target in modules}
        for target in explicit | implicit:
            edges.update(p for p in prefixes(target)[:-1] if p in modules and p not in enclosing)
        edges.update(target for target in implicit if target in modules and target not in enclosing)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module, and modules that import themselves
    (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(graph.get(node, ())):
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
            if len(component) > 1 or node in graph.get(node, ()):
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def loop(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """One shortest import loop through the component's first module, for people to read."""
    start = component[0]
    paths = {start: [start]}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for other in sorted(graph[node] & set(component)):
            if other == start:
                return paths[node] + [start]
            if other not in paths:
                paths[other] = paths[node] + [other]
                queue.append(other)
    return component


def import_cycles(root: Path, package: str) -> list[str]:
    """Every import cycle among the modules of `package` under `root`, one line each: the modules of the
    cycle, and one loop through them."""
    graph = import_graph(root, package)
    return [f"{', '.join(c)}: {' -> '.join(loop(graph, c))}" for c in cycles(graph)]


def test_no_import_cycles():
    graph = import_graph(PACKAGE.parent, PACKAGE.name)
    assert graph["zerotrain.doctor"] and graph["zerotrain.planner.trace"], "the graph must see imports"
    found = import_cycles(PACKAGE.parent, PACKAGE.name)
    assert found == [], f"{len(found)} import cycles:\n" + "\n".join(found)


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"a"}, "b": set()}) == [["a"]]


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def test_the_checker_sees_typing_only_and_lazy_imports(tmp_path):
    """A cycle made only of an import under TYPE_CHECKING and one inside a function is found."""
    write(tmp_path / "pkg" / "__init__.py", "")
    write(tmp_path / "pkg" / "low.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.high import H\n")
    write(tmp_path / "pkg" / "high.py", "def f():\n    from . import low\n    return low\n")
    assert import_cycles(tmp_path, "pkg") == ["pkg.high, pkg.low: pkg.high -> pkg.low -> pkg.high"]


def test_the_checker_sees_package_inits_and_plugin_discovery(tmp_path):
    """Importing a.b.c runs a.b's __init__; an __init__ that import_module()s a computed name imports
    its submodules (plug-ins). A submodule importing a sibling does not depend on its own package."""
    write(tmp_path / "pkg" / "__init__.py", "")
    write(tmp_path / "pkg" / "models" / "__init__.py", "from pkg.models.catalog import SPEC\n")
    write(tmp_path / "pkg" / "models" / "catalog.py", "import pkg.plugins\nfrom pkg.models import parts\n")
    write(tmp_path / "pkg" / "models" / "parts.py", "")
    write(tmp_path / "pkg" / "plugins" / "__init__.py",
          "import importlib\ndef load(n):\n    return importlib.import_module(f'{__name__}.{n}')\n")
    write(tmp_path / "pkg" / "plugins" / "one.py", "def tiny():\n    import pkg.models.parts\n")
    cycle = ("pkg.models, pkg.models.catalog, pkg.plugins, pkg.plugins.one: "
             "pkg.models -> pkg.models.catalog -> pkg.plugins -> pkg.plugins.one -> pkg.models")
    assert import_cycles(tmp_path, "pkg") == [cycle]
    write(tmp_path / "pkg" / "plugins" / "one.py", "")
    assert import_cycles(tmp_path, "pkg") == []


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
    for family in families.all_families():  # a second family of a class is found by name (families.for_config)
        assert family.denoiser_classes and (families.by_class(family.denoiser_classes[0]) is family
                                            or not family.default_for_class)


# What families/ (the family modules, base and parts) may import of zerotrain besides families/ itself: the
# leaf modules below it. Everything else (models, planner, data, train, ...) sits above and asks the families.
BELOW_FAMILIES = {"zerotrain.errors", "zerotrain.protocols", "zerotrain.quiet", "zerotrain.recompute"}


def torch_side_of(module: str) -> str:
    """zerotrain.families.x -> zerotrain.families.runtime.x: where a family's (or part's) torch side lives."""
    return module.replace("zerotrain.families.", "zerotrain.families.runtime.", 1)


def family_rule_breaks(graph: dict[str, set[str]], family_modules: set[str]) -> list[str]:
    """Import edges that break families/' rules: a family module importing another family module, a family's
    torch side importing another family's declarations or torch side, a part (or base) importing a family
    module, families/ importing a module above it. One line each. The package's __init__ finds the families,
    so it imports them all; a family's torch side imports its own declarations."""
    torch_sides = {torch_side_of(module): module for module in family_modules}
    found = []
    for name, edges in sorted(graph.items()):
        if not name.startswith("zerotrain.families"):
            continue
        for target in sorted(edges - {name}):
            own = torch_sides.get(name) == target
            if (target in family_modules or target in torch_sides) and name != "zerotrain.families" and not own:
                found.append(f"{name} imports the family module {target}")
            elif not target.startswith("zerotrain.families") and target not in BELOW_FAMILIES | {"zerotrain"}:
                found.append(f"{name} imports {target}, above families/")
    return found


def test_no_family_imports_another_and_families_import_nothing_above():
    """Families are composed from parts (zerotrain/families/parts/): what two families share lives there,
    once, and no family module imports another; families/ imports only the leaf modules below it."""
    family_modules = {type(f).__module__ for f in families.all_families()}
    assert len(family_modules) == len(families.all_families()) >= 11
    assert family_rule_breaks(import_graph(PACKAGE.parent, PACKAGE.name), family_modules) == []


def test_the_family_rule_finder_sees_sibling_and_upward_imports(tmp_path):
    package = tmp_path / "zerotrain"
    for path, text in {"__init__.py": "", "errors.py": "", "planner.py": "",
                       "families/__init__.py": "", "families/base.py": "",
                       "families/parts/__init__.py": "", "families/parts/vae.py": "from zerotrain.families import b\n",
                       "families/a.py": "from zerotrain.families.parts import vae\nfrom zerotrain import errors\n",
                       "families/b.py": "def f():\n    from zerotrain.families.a import X\n    from zerotrain import planner\n",
                       "families/runtime/__init__.py": "",
                       "families/runtime/a.py": "from zerotrain.families.a import A\n",
                       "families/runtime/b.py": "from zerotrain.families.b import B\nfrom zerotrain.families.runtime import a\n",
                       }.items():
        (package / path).parent.mkdir(parents=True, exist_ok=True)
        (package / path).write_text(text)
    graph = import_graph(tmp_path, "zerotrain")
    assert family_rule_breaks(graph, {"zerotrain.families.a", "zerotrain.families.b"}) == [
        "zerotrain.families.b imports the family module zerotrain.families.a",
        "zerotrain.families.b imports zerotrain.planner, above families/",
        "zerotrain.families.parts.vae imports the family module zerotrain.families.b",
        "zerotrain.families.runtime.b imports the family module zerotrain.families.runtime.a",
    ]


# What a family's declarations may not import, at any depth: the planner reads them without torch
# (zerotrain.families.parts.declared).
HEAVY = {"torch", "diffusers", "transformers", "tokenizers", "peft", "safetensors", "optimum", "bitsandbytes",
         "deepspeed", "PIL", "numpy", "zerotrain.families.runtime"}


def two_sides_breaks(root: Path) -> list[str]:
    """Under families/ (`root`): a declarations module (outside runtime/) that imports a heavy library or a
    torch side anywhere in it, and a torch side (under runtime/) that imports inside a function rather than at
    module level. One line each."""
    found = []
    for path in sorted(root.rglob("*.py")):
        where = path.relative_to(root.parent)
        tree = ast.parse(path.read_text(encoding="utf-8"))
        torch_side = "runtime" in path.relative_to(root).parts
        nested = {id(node) for fn in ast.walk(tree) if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef)
                  for node in ast.walk(fn)}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            if torch_side and id(node) in nested:
                found.append(f"{where}:{node.lineno} imports {', '.join(names)} inside a function")
            heavy = [n for n in names if any(n == h or n.startswith(h + ".") for h in HEAVY)]
            if not torch_side and heavy:
                found.append(f"{where}:{node.lineno} imports {', '.join(heavy)} in a family's declarations")
    return found


def test_declarations_import_no_torch_and_torch_sides_import_at_module_level():
    """Each side of a family imports at module level: the declarations nothing heavy (not even lazily), the
    torch side (zerotrain/families/runtime/) everything it needs, at its top."""
    assert (PACKAGE / "families" / "runtime" / "base.py").is_file()
    assert two_sides_breaks(PACKAGE / "families") == []


def test_the_two_sides_finder_sees_lazy_and_heavy_imports(tmp_path):
    root = tmp_path / "families"
    for path, text in {"a.py": "def f():\n    import torch\n",
                       "b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from diffusers import X\n",
                       "c.py": "from zerotrain.families.runtime.parts import tiny\nimport json\n",
                       "runtime/a.py": "import torch\n\n\ndef f():\n    from transformers import T5Config\n",
                       "runtime/b.py": "import torch\nfrom diffusers import FluxPipeline\n"}.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    assert two_sides_breaks(root) == [
        "families/a.py:2 imports torch in a family's declarations",
        "families/b.py:3 imports diffusers in a family's declarations",
        "families/c.py:1 imports zerotrain.families.runtime.parts in a family's declarations",
        "families/runtime/a.py:5 imports transformers inside a function",
    ]


# train.py reads top to bottom as an entry point (DESIGN.md): the loop, its parts and how they are built
# live in trainer.py and the modules that own them. It was 298 lines when the Trainer landed.
TRAIN_PY_LIMIT = 300
# No function over about 80 lines (DESIGN.md rule 12): a long function is several jobs without names.
FUNCTION_LIMIT = 80


def long_functions(root: Path, limit: int) -> list[str]:
    """Every function or method under `root` longer than `limit` lines (from its def to its last line,
    docstring included), as path:line name (lines)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_train_py_stays_an_entry_point_under_300_lines():
    lines = len((PACKAGE / "train.py").read_text(encoding="utf-8").splitlines())
    assert lines < TRAIN_PY_LIMIT, f"zerotrain/train.py is {lines} lines: move what it does to where it belongs"


def test_no_function_in_zerotrain_is_longer_than_80_lines():
    found = long_functions(PACKAGE, FUNCTION_LIMIT)
    assert found == [], f"{len(found)} functions over {FUNCTION_LIMIT} lines:\n" + "\n".join(found)


def test_the_length_check_sees_a_long_method(tmp_path):
    body = "".join(f"        x = {i}\n" for i in range(80))
    write(tmp_path / "pkg" / "mod.py", f"class A:\n    def long(self):\n{body}\n    def short(self):\n        pass\n")
    assert long_functions(tmp_path / "pkg", 80) == ["pkg/mod.py:2 long (81 lines)"]


def test_no_module_imports_an_entry_point():
    """The entry points sit on top: only cli imports train.py (`zerotrain train`), and nothing imports cli.
    calibrate and planner.presets once did."""
    graph = import_graph(PACKAGE.parent, PACKAGE.name)
    importers = {entry: sorted(name for name, edges in graph.items() if entry in edges)
                 for entry in ("zerotrain.train", "zerotrain.cli")}
    assert importers == {"zerotrain.train": ["zerotrain.cli"], "zerotrain.cli": []}


def test_no_two_test_files_share_a_name():
    """pytest's default import mode puts each test folder on sys.path and imports a test file by its bare name,
    so tests/unit/test_x.py and tests/e2e/test_x.py cannot both be collected in one run: the whole suite stops
    at collection ("import file mismatch"), though each folder alone passes."""
    tests = PACKAGE.parent / "tests"
    by_name: dict[str, list[str]] = {}
    for path in sorted(tests.rglob("test_*.py")):
        by_name.setdefault(path.name, []).append(str(path.relative_to(tests)))
    assert {name: paths for name, paths in by_name.items() if len(paths) > 1} == {}
