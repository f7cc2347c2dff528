"""What the family unit tests share: the resolved spec of a model name or path, seeded generators, a
plan through the CLI (planned) of a catalog name or a bare config.json (bare_config), and the
module-scoped fixtures of one tiny model (tiny_fixtures): its folder, built once per session as
ensure_tiny_pipeline lays it out (tiny_root()/<name>), its pipeline loaded with from_pretrained, and
zerotrain's encoders for it (load_encoders)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from zerotrain.config import ModelConfig
from zerotrain.models.catalog import resolve_model
from zerotrain.protocols import ModelSpec


def spec_of(name: str | Path) -> ModelSpec:
    return resolve_model(ModelConfig(name_or_path=str(name)))


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def plan_json(capsys: Any, model: str | Path, *args: str) -> dict[str, Any]:
    """The plan `zerotrain plan --model MODEL ARGS --json` prints (its exit code 0 asserted)."""
    from zerotrain.cli import main

    assert main(["plan", "--model", str(model), *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)["plan"]


def bare_config(folder: Path, config: dict[str, Any]) -> Path:
    """A denoiser config.json alone, as folder/transformer/config.json."""
    path = Path(folder) / "transformer" / "config.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(config))
    return path


_ROOT: list[Path] = []
_SHARED: dict[tuple[str, ...], Any] = {}


def tiny_root(tmp_path_factory: Any) -> Path:
    """The session's folder of tiny models (ensure_tiny_pipeline builds each there once): shared by every module
    that tests a tiny model, test_families.py's table and the family's own file."""
    if not _ROOT:
        _ROOT.append(tmp_path_factory.mktemp("models"))
    return _ROOT[0]


def shared(key: tuple[str, ...], make: Any) -> Any:
    """make(), once per session for `key`: a tiny model's pipeline or encoders, loaded once for test_families.py's
    table and the family's own file (which run in one session; neither leaves an adapter loaded in them)."""
    if key not in _SHARED:
        _SHARED[key] = make()
    return _SHARED[key]


def tiny_pipeline(folder: Path, pipeline_class: str, **components: Any) -> Any:
    """The diffusers pipeline `pipeline_class` of a tiny folder (its progress bar off), shared by the session."""
    def load():
        import diffusers

        pipe = getattr(diffusers, pipeline_class).from_pretrained(folder, **components)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    return shared(("pipeline", str(folder), pipeline_class), load)


def tiny_encoders(folder: Path) -> Any:
    """zerotrain's encoders (load_encoders) of a tiny folder, shared by the session."""
    from zerotrain.models.conditioning import load_encoders

    return shared(("encoders", str(folder)), lambda: load_encoders(spec_of(folder), folder))


def tiny_fixtures(name: str, pipeline_class: str) -> tuple[Any, Any, Any, Any]:
    """Module fixtures root, folder, pipeline and encoders for the tiny catalog model `name`, whose
    pipeline is the diffusers class `pipeline_class`: assign them at a test module's top level,
    `root, folder, pipeline, encoders = tiny_fixtures(...)`."""

    @pytest.fixture(scope="module", name="root")
    def root(tmp_path_factory) -> Path:
        return tiny_root(tmp_path_factory)

    @pytest.fixture(scope="module", name="folder")
    def folder(root) -> Path:
        from zerotrain.models.tiny import ensure_tiny_pipeline

        return ensure_tiny_pipeline(name, root)

    @pytest.fixture(scope="module", name="pipeline")
    def pipeline(folder):
        return tiny_pipeline(folder, pipeline_class)

    @pytest.fixture(scope="module", name="encoders")
    def encoders(folder):
        return tiny_encoders(folder)

    return root, folder, pipeline, encoders
