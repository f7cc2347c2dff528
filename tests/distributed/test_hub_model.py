"""A model named by its hub id trains, end to end, on two ranks: the real huggingface_hub downloads from a
hub on 127.0.0.1 (tests/hub_server.py) what training reads, the denoiser and the scheduler too, once per
node, and nothing else of the repo; the run builds its cache, trains, renders its validation images and
exports."""

from __future__ import annotations

import re
import shutil

import pytest

from tests.hub_server import LocalHub

pytestmark = pytest.mark.distributed

REPO = "zerotrain-tests/tiny-flux"
# What a real pipeline repo holds beside what from_pretrained loads: a variant, pickled weights beside the
# safetensors, and a single-file checkpoint at the root.
DECOYS = ["transformer/diffusion_pytorch_model.fp16.safetensors", "vae/diffusion_pytorch_model.bin",
          "tiny-flux.safetensors"]


def test_a_hub_id_trains_validates_and_exports(train, shared_cache, tmp_path, monkeypatch):
    served = shutil.copytree(shared_cache / "models" / "tiny-flux", tmp_path / "served")
    for name in DECOYS:
        (served / name).write_bytes(b"not read by training")
    with LocalHub() as hub:
        hub.add(REPO, served)
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        result = train("hub", f"model.name_or_path={REPO}", "training.max_steps=2", "training.checkpoint_every=2",
                       "validation.prompts=[a red square]", "validation.every=2", "validation.steps=2").check()
    files = sorted(p.relative_to(served).as_posix() for p in served.rglob("*") if p.is_file())
    wanted = [name for name in files if name not in DECOYS]
    assert sorted(hub.downloaded(REPO)) == wanted  # each once (one node), the denoiser and scheduler included
    assert "scheduler/scheduler_config.json" in wanted and "transformer/diffusion_pytorch_model.safetensors" in wanted
    assert re.search(rf"downloading \d+ files of hub repo {REPO} \(.*\) into {tmp_path / 'hf' / 'hub'}", result.log)
    out = result.output_dir
    assert list((out / "validation").rglob("*-seed0.png")), "no validation image"
    from diffusers import FluxTransformer2DModel

    exported = FluxTransformer2DModel.from_pretrained(out / "export" / "transformer")
    assert sum(p.numel() for p in exported.parameters()) > 0
