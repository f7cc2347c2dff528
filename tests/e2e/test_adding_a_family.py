"""docs/families.md's "Adding a family" lists every file a new family needs, and no more. The proof: a copy of the
repository gets exactly what the list names for a test-only family (tests/e2e/new_family/: FLUX.1's parts under
the name flux_lite, its declarations and its torch side, its catalog configs naming it with "_zerotrain_family", its table rows and README row), then
`zerotrain regenerate flux-lite` runs in the copy (the copy's zerotrain, not the installed one). The files that
changed are exactly those and what regenerate writes (the new model's shipped facts; the presets come out the
same); in the copy the new row's conformance checks pass (tests/unit/test_families.py), as do the tests of the
layout, the README, the catalog and the shipped facts; `zerotrain plan` plans flux-lite from its shipped facts;
and the two-rank table collects the new row's runs (collected only: a FLUX.1-shaped family trains as FLUX.1 does,
whose two-rank runs tests/distributed has).

Resolving a family by the key (zerotrain.families.for_config) is checked here too: a config without it, its
one-line errors, the facts' key that keeps it, and a tiny folder whose transformer's config.json keeps it."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DATA = Path(__file__).with_name("new_family")
NAME, MODEL = "flux_lite", "flux-lite"

# The list, as this family follows it: path in the repository -> how it is written into the copy.
# The family's declarations, and its torch side (zerotrain.families.parts.declared).
FAMILY_FILES = {f"zerotrain/families/{NAME}.py": f"{NAME}.py",
                f"zerotrain/families/runtime/{NAME}.py": f"runtime_{NAME}.py"}
CATALOG_FILES = (f"zerotrain/models/catalog/{MODEL}.json", f"zerotrain/models/catalog/tiny-{MODEL}.json")
TABLE_ROWS = {"tests/unit/test_families.py": "test_families_row.txt",
              "tests/distributed/test_train_table.py": "test_train_table_row.txt"}
README_ROW = ("README.md", "readme_row.md", "<!-- end families table -->")
LISTED = {*FAMILY_FILES, *CATALOG_FILES, *TABLE_ROWS, README_ROW[0]}
# What `zerotrain regenerate flux-lite` writes that differs: the new model's shipped facts (it rewrites every
# preset in deepspeed_configs/ too, which adding a family leaves as they were).
GENERATED = {f"zerotrain/planner/shipped_facts/{MODEL}.json"}
# Folders no file of the repository lives in.
NOT_SOURCE = {".git", ".venv", "__pycache__", ".pytest_cache", ".ruff_cache", "build", "dist"}


def repository_files(root: Path) -> list[str]:
    """The checkout's files (git's tracked and untracked-but-not-ignored ones that exist), or, without git, every
    file outside NOT_SOURCE and *.egg-info."""
    try:
        listed = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                                capture_output=True, check=True).stdout.decode().split("\0")
        return sorted({name for name in listed if name and (root / name).is_file()})
    except (OSError, subprocess.CalledProcessError):
        return sorted(str(path.relative_to(root)) for path in root.rglob("*") if path.is_file()
                      and not any(part in NOT_SOURCE or part.endswith(".egg-info") for part in path.relative_to(root).parts))


def digests(root: Path) -> dict[str, str]:
    """sha256 of every file under root (bytecode caches left out), by relative path."""
    return {str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest() for path in root.rglob("*")
            if path.is_file() and not NOT_SOURCE & set(path.relative_to(root).parts)}


def insert_before(text: str, line: str, start: str, row: str, where: str) -> str:
    """`row` (whole lines) inserted before the first line that starts with `line` after `start`."""
    begin = text.find(start)
    end = text.find("\n" + line, begin) if begin >= 0 else -1
    if end < 0:
        raise AssertionError(f"{where}: no line {line!r} after {start!r}; the list's row cannot be added there")
    return text[:end + 1] + row + text[end + 1:]


def follow_the_list(copy: Path) -> None:
    """Write into the copy exactly what "Adding a family" names: the family file, its catalog configs, its rows."""
    for path, name in FAMILY_FILES.items():
        shutil.copyfile(DATA / name, copy / path)
    for path in CATALOG_FILES:
        shutil.copyfile(DATA / Path(path).name, copy / path)
    rows = [(path, row, "]\n", "\nFAMILIES = [") for path, row in TABLE_ROWS.items()]  # before its closing bracket
    for path, row, line, start in [*rows, (*README_ROW, "<!-- families table -->")]:
        text = (copy / path).read_text(encoding="utf-8")
        (copy / path).write_text(insert_before(text, line, start, (DATA / row).read_text(), path), encoding="utf-8")


@dataclasses.dataclass(frozen=True)
class Copy:
    """The copy of the repository, the environment its commands run in, `zerotrain regenerate`'s result there and
    the files that changed."""

    root: Path
    env: dict[str, str]
    regenerate: subprocess.CompletedProcess | None = None
    changed: frozenset[str] = frozenset()

    def run(self, *args: str, timeout: int = 240) -> subprocess.CompletedProcess:
        """A command in the copy, its zerotrain on PYTHONPATH."""
        return subprocess.run(args, cwd=self.root, env=self.env, capture_output=True, text=True, timeout=timeout,
                              check=False)

    def pytest(self, tmp: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict[str, str]]:
        """pytest in the copy; its outcome per test id (passed, failed, error, skipped) from its JUnit XML."""
        report = tmp / "report.xml"
        result = self.run(sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}",
                          f"--basetemp={tmp / 'base'}", *args, timeout=300)
        outcomes = {}
        if report.is_file():
            for case in ET.parse(report).getroot().iter("testcase"):
                kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
                outcomes[f"{case.get('classname')}::{case.get('name')}"] = kinds[0] if kinds else "passed"
        return result, outcomes


def tail(result: subprocess.CompletedProcess, lines: int = 40) -> str:
    return "\n".join((result.stdout + result.stderr).splitlines()[-lines:])


@pytest.fixture(scope="module")
def copy(tmp_path_factory) -> Copy:
    root = tmp_path_factory.mktemp("repository")
    for name in repository_files(ROOT):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, root / name)
    before = digests(root)
    follow_the_list(root)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
           "PYTHONDONTWRITEBYTECODE": "1", "XDG_CACHE_HOME": str(tmp_path_factory.mktemp("xdg-cache")),
           "HF_HUB_OFFLINE": "1"}
    env.pop("PYTEST_ADDOPTS", None)
    copied = Copy(root, env)
    where = copied.run(sys.executable, "-c", "import zerotrain; print(zerotrain.__file__)")
    assert Path(where.stdout.strip()).is_relative_to(root), f"the copy imported {where.stdout or where.stderr}"
    regenerate = copied.run(sys.executable, "-m", "zerotrain.cli", "regenerate", MODEL, timeout=400)
    after = digests(root)
    changed = frozenset(path for path in before.keys() | after.keys() if before.get(path) != after.get(path))
    return dataclasses.replace(copied, regenerate=regenerate, changed=changed)


def test_regenerate_runs_in_the_copy(copy):
    assert copy.regenerate.returncode == 0, tail(copy.regenerate)


def test_adding_the_family_changes_only_what_the_list_names(copy):
    assert copy.regenerate.returncode == 0, tail(copy.regenerate)
    unlisted = sorted(copy.changed - LISTED - GENERATED)
    unwritten = sorted((LISTED | GENERATED) - copy.changed)
    assert not unlisted, f"files the list does not name changed: {unlisted}"
    assert not unwritten, f"the list names files that did not change: {unwritten}"


def test_the_new_rows_conformance_checks_pass(copy, tmp_path):
    """Every check test_families.py's row enables runs and passes (the row's own and the catalog's parameter
    counts by catalog name; the table's check that every family and catalog model has a row), on a tiny folder
    that names the family."""
    result, outcomes = copy.pytest(tmp_path, "tests/unit/test_families.py", "-k", f"{NAME} or {MODEL} or has_a_row")
    assert result.returncode == 0, tail(result)
    ran = {test for test in outcomes if NAME in test or MODEL in test}
    assert not [test for test in ran if outcomes[test] != "passed"], outcomes
    # parameters (2 names), defaults, plan, bare, text_encoded, latents, shifts, scheduler, planner_out, backprop,
    # guidance (the render), lora and read_back (the ComfyUI model): each enabled by the row.
    assert len(ran) >= 14, sorted(ran)
    assert any("has_a_row" in test for test in outcomes)
    # The tiny folder the checks built keeps the key in its transformer's config.json: it is flux_lite's.
    configs = sorted((tmp_path / "base").glob(f"**/tiny-{MODEL}/transformer/config.json"))
    assert configs and {json.loads(path.read_text()).get("_zerotrain_family") for path in configs} == {NAME}, configs


def test_the_copys_layout_readme_catalog_and_shipped_facts_tests_pass(copy, tmp_path):
    """No family imports another, the docs' commands and links hold, every catalog model resolves and builds, and
    every shipped run of every catalog model is in the shipped facts (no trace)."""
    result, outcomes = copy.pytest(tmp_path, "tests/unit/test_layout.py", "tests/unit/test_protocols.py",
                                   "tests/unit/test_readme.py", "tests/unit/test_catalog.py",
                                   "tests/unit/test_shipped_facts.py::test_every_catalog_model_resolution_and_mode_is_shipped")
    assert result.returncode == 0, tail(result)
    assert any(MODEL in test for test in outcomes), "no catalog test saw flux-lite"


def test_zerotrain_plan_plans_the_new_model_from_its_shipped_facts(copy):
    result = copy.run(sys.executable, "-m", "zerotrain.cli", "plan", "--model", MODEL, "--resolution", "1024",
                      "--gpus", "1xH100-80GB", "--mode", "lora", "--json")
    assert result.returncode == 0, tail(result)
    out = json.loads(result.stdout)
    assert out["plan"]["model"] == MODEL and out["plan"]["chosen"]["fits"] is True
    assert out["facts_cached"] is True, "traced: flux-lite's shipped facts should hold this run"


def test_the_two_rank_table_collects_the_new_row(copy, tmp_path):
    """Collected only; without the conftest files, whose hook builds DeepSpeed's ops for a session that collects
    distributed tests (and waits for the build at its end)."""
    result = copy.run(sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--noconftest", "--collect-only", "-q",
                      f"--basetemp={tmp_path / 'base'}", "tests/distributed/test_train_table.py", "-k", MODEL)
    collected = [line for line in result.stdout.splitlines() if line.startswith("tests/")]
    assert collected, f"tests/distributed/test_train_table.py collects no {MODEL} run: {tail(result)}"
    assert result.returncode == 0, tail(result)
    assert any("sigterm" in test for test in collected) and any("full" in test for test in collected), collected
    assert any(f"{MODEL}-lora" in test for test in collected), collected


# --- the family a config names (zerotrain.families.for_config) ---------------------------------------------------


def spec_of(path: Path):
    from zerotrain.config import ModelConfig
    from zerotrain.models.catalog import resolve_model

    return resolve_model(ModelConfig(name_or_path=str(path)))


def tiny_flux(tmp_path: Path, **keys) -> Path:
    from zerotrain.models.catalog import _catalog_entry

    path = tmp_path / "transformer" / "config.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({**_catalog_entry("tiny-flux")["denoiser"], **keys}))
    return path


def test_a_config_without_the_key_trains_with_its_class_default(tmp_path):
    from zerotrain.planner.measure import architecture

    spec = spec_of(tiny_flux(tmp_path))
    assert spec.family == "flux" and "_zerotrain_family" not in architecture(spec.config)


@pytest.mark.parametrize(("named", "says"), [
    ("flux_lit", r'"_zerotrain_family": "flux_lit" names no model family \(zerotrain knows .*\bchroma\b.*\); name one'),
    ("chroma", (r'"_zerotrain_family": "chroma" trains ChromaTransformer2DModel, not FluxTransformer2DModel; name '
                r"a family of FluxTransformer2DModel \(flux\)")),
])
def test_a_config_naming_a_wrong_family_is_one_line(tmp_path, named, says):
    from zerotrain.errors import ZerotrainError

    path = tiny_flux(tmp_path, _zerotrain_family=named)
    with pytest.raises(ZerotrainError, match=says) as info:
        spec_of(path)
    assert "\n" not in str(info.value) and str(info.value).startswith(f"model.name_or_path: {path}: ")


def test_the_key_names_the_family_and_the_facts_keep_it(tmp_path):
    """A config that names its class's default family is that family's, and its facts' key differs from the
    same config's without the key: facts of one family never serve another."""
    from zerotrain.planner.measure import architecture

    named, plain = spec_of(tiny_flux(tmp_path / "a", _zerotrain_family="flux")), spec_of(tiny_flux(tmp_path / "b"))
    assert named.family == plain.family == "flux"
    assert architecture(named.config) == {**architecture(plain.config), "_zerotrain_family": "flux"}


def test_a_tiny_folder_keeps_the_key_and_resolves_to_the_family_it_names(tmp_path, monkeypatch):
    from zerotrain.models import tiny

    entry = tiny._catalog_entry("tiny-flux")
    monkeypatch.setattr(tiny, "_catalog_entry", lambda name: {**entry, "denoiser": {**entry["denoiser"],
                                                                                    "_zerotrain_family": "flux"}})
    folder = tiny.build_tiny_pipeline("tiny-flux", tmp_path / "tiny")
    assert json.loads((folder / "transformer" / "config.json").read_text())["_zerotrain_family"] == "flux"
    assert spec_of(folder).config["_zerotrain_family"] == "flux"
