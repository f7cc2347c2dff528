"""Checkpoint integrity without a process group: checksums recorded at save, damage found at
resume (a flipped byte, a truncated or missing file, an unreadable state file), the fallback to
the previous intact checkpoint, random-generator state that loads with weights_only=True, and the
ZeRO stage a resume keeps."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from zerotrain.checkpoint import STATE, checksums, damage, restore_rng, rng_state, usable
from zerotrain.distributed import Topology
from zerotrain.errors import ZerotrainError

ONE = Topology(0, 1, 0)


def make_checkpoint(root, step: int):
    """A checkpoint folder as save() leaves it: files, then zerotrain_state.json with their checksums."""
    folder = root / "checkpoints" / f"step-{step:08d}"
    folder.mkdir(parents=True)
    torch.save({"w": torch.arange(1000, dtype=torch.float32) * step}, folder / "mp_rank_00_model_states.pt")
    torch.save({"m": torch.ones(3000) * step}, folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    (folder / "sub").mkdir()
    (folder / "sub" / "extra.bin").write_bytes(bytes(range(256)) * 10)
    files = checksums(folder, ONE)
    (folder / STATE).write_text(json.dumps({"step": step, "files": files}))
    (root / "checkpoints" / "latest").write_text(folder.name)
    return folder


def test_checksums_cover_every_file_but_the_state(tmp_path):
    folder = make_checkpoint(tmp_path, 2)
    recorded = json.loads((folder / STATE).read_text())["files"]
    assert sorted(recorded) == ["mp_rank_00_model_states.pt", "sub/extra.bin",
                                "zero_pp_rank_0_mp_rank_00_optim_states.pt"]
    assert recorded["sub/extra.bin"]["bytes"] == 2560
    assert damage(folder, ONE) is None


def test_a_flipped_byte_is_named(tmp_path):
    folder = make_checkpoint(tmp_path, 2)
    victim = folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x10
    victim.write_bytes(bytes(data))
    assert damage(folder, ONE) == f"{victim} does not match its SHA-256 checksum"


def test_a_truncated_or_missing_file_is_named(tmp_path):
    folder = make_checkpoint(tmp_path, 2)
    victim = folder / "mp_rank_00_model_states.pt"
    size = victim.stat().st_size
    victim.write_bytes(victim.read_bytes()[: size // 2])
    assert damage(folder, ONE) == f"{victim} has {size // 2} bytes, {size} were written"
    (folder / "sub" / "extra.bin").unlink()
    assert damage(folder, ONE) == f"{victim} has {size // 2} bytes, {size} were written (and 1 more)"
    victim.unlink()
    (folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt").unlink()
    assert damage(folder, ONE) == f"{victim} is missing (and 2 more)"


def test_an_unreadable_state_file_is_damage_and_an_old_one_without_checksums_is_not(tmp_path):
    folder = make_checkpoint(tmp_path, 2)
    (folder / STATE).write_text('{"step": 2, "fil')
    assert damage(folder, ONE).startswith(f"{folder / STATE} cannot be read")
    (folder / STATE).write_text('{"step": 2}')  # saved by a zerotrain before checksums
    assert damage(folder, ONE) is None


def test_resume_falls_back_to_the_newest_intact_checkpoint(tmp_path, capsys):
    make_checkpoint(tmp_path, 2)
    second = make_checkpoint(tmp_path, 4)
    newest = make_checkpoint(tmp_path, 6)
    (newest / "mp_rank_00_model_states.pt").write_bytes(b"garbage")
    (second / "sub" / "extra.bin").write_bytes(b"")
    chosen = usable(tmp_path, newest, ONE, fall_back=True)
    assert chosen == tmp_path / "checkpoints" / "step-00000002"
    warning = capsys.readouterr().err
    assert f"checkpoint {newest} is damaged: {newest / 'mp_rank_00_model_states.pt'} has 7 bytes" in warning
    assert f"checkpoint {second} is damaged" in warning
    assert f"resuming from {chosen}, the newest intact checkpoint" in warning


def test_no_intact_checkpoint_or_an_explicit_damaged_one_stops_with_one_line(tmp_path):
    only = make_checkpoint(tmp_path, 2)
    (only / "mp_rank_00_model_states.pt").write_bytes(b"")
    with pytest.raises(ZerotrainError, match="no intact checkpoint is left to resume from") as err:
        usable(tmp_path, only, ONE, fall_back=True)
    assert "\n" not in str(err.value)
    intact = make_checkpoint(tmp_path, 4)
    (intact / "mp_rank_00_model_states.pt").write_bytes(b"")
    make_checkpoint(tmp_path / "other", 2)
    with pytest.raises(ZerotrainError, match=f"checkpoint {intact} is damaged"):
        usable(tmp_path, intact, ONE, fall_back=False)  # training.resume named it: no silent substitute
    assert usable(tmp_path, None, ONE, fall_back=True) is None


def test_rng_state_loads_with_weights_only_and_restores_every_generator(tmp_path):
    generator = torch.Generator().manual_seed(7)
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    torch.save(rng_state({"objective": generator}), tmp_path / "rng-0.pt")
    expected = (random.random(), np.random.rand(), torch.rand(1).item(), torch.rand(1, generator=generator).item())
    random.seed(9)
    np.random.seed(9)
    torch.manual_seed(9)
    generator.manual_seed(9)
    restore_rng(torch.load(tmp_path / "rng-0.pt", weights_only=True), {"objective": generator})
    assert (random.random(), np.random.rand(), torch.rand(1).item(),
            torch.rand(1, generator=generator).item()) == expected


def visible_gpus(monkeypatch, count: int, current: int) -> tuple[torch.Generator, ...]:
    """CUDA's generator API stood in for where CUDA is absent (this CPU build): `count` visible GPUs, each a
    generator of its own, the rank's device `current`; setting every state past the visible ones raises
    IndexError, as torch.cuda.set_rng_state_all does (it indexes torch.cuda.default_generators)."""
    from zerotrain import checkpoint

    gpus = tuple(torch.Generator().manual_seed(100 + i) for i in range(count))

    def set_all(states):
        for index, state in enumerate(states):
            gpus[index].set_state(state)

    monkeypatch.setattr(checkpoint, "accelerator", lambda: ("cuda", "nccl"))
    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    monkeypatch.setattr(torch.cuda, "default_generators", gpus)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [g.get_state() for g in gpus])
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", set_all)
    return gpus


def draw(generator: torch.Generator) -> float:
    return torch.rand(1, generator=generator).item()


def test_a_resume_on_fewer_gpus_restores_the_ranks_own_device_generator(tmp_path, monkeypatch):
    """Rank 3 of a node with 8 visible GPUs saves, and resumes on a node with 4: it gets back its own device's
    draws (every visible GPU's states, saved before, raised IndexError on 4)."""
    from zerotrain.checkpoint import device_generator

    saved_on = visible_gpus(monkeypatch, 8, current=3)
    torch.save(rng_state({}, device_generator()), tmp_path / "rng-3.pt")
    expected = draw(saved_on[3])
    resumed_on = visible_gpus(monkeypatch, 4, current=3)
    restore_rng(torch.load(tmp_path / "rng-3.pt", weights_only=True), {}, device_generator())
    assert draw(resumed_on[3]) == expected
    assert [draw(g) for g in resumed_on[:3]] == [draw(torch.Generator().manual_seed(100 + i)) for i in range(3)]


def test_a_checkpoint_with_every_visible_gpus_state_resumes_on_fewer(tmp_path, monkeypatch):
    """A checkpoint zerotrain wrote before (its "cuda": 8 GPUs' states) resumed with 4 visible: the rank takes its
    device's state from the list; one whose device the old run did not have keeps its fresh state."""
    from zerotrain.checkpoint import device_generator

    old = [torch.Generator().manual_seed(200 + i) for i in range(2)]
    state = {**rng_state({}), "cuda": [g.get_state() for g in old]}
    expected = draw(old[1])
    gpus = visible_gpus(monkeypatch, 4, current=1)
    restore_rng(state, {}, device_generator())
    assert draw(gpus[1]) == expected
    fresh = visible_gpus(monkeypatch, 4, current=3)
    restore_rng(state, {}, device_generator())
    assert draw(fresh[3]) == draw(torch.Generator().manual_seed(103))


def test_a_resume_keeps_the_zero_stage_it_was_saved_under(tmp_path):
    from pathlib import Path

    from zerotrain.checkpoint import needs_universal, resume_stage
    from zerotrain.config import load_config

    config = Path(__file__).resolve().parents[2] / "examples" / "tiny-cpu.yaml"
    folder = make_checkpoint(tmp_path, 2)
    (folder / STATE).write_text(json.dumps({"step": 2, "world_size": 2, "zero_stage": 2}))
    run = load_config(config, [])
    assert resume_stage(run, folder).planner.stages == [2]  # the search may change only the world size
    assert run.planner.stages == [0, 1, 2, 3]
    with pytest.raises(ZerotrainError, match=r"saved under ZeRO-2, which planner.stages=\[3\] excludes"):
        resume_stage(load_config(config, ["planner.stages=[3]"]), folder)
    assert needs_universal(folder, 1, 2) and not needs_universal(folder, 2, 2)
    with pytest.raises(ZerotrainError, match="this run's DeepSpeed config uses ZeRO-3; a checkpoint resumes under"):
        needs_universal(folder, 2, 3)


def test_a_resume_keeps_the_optimizer_it_was_saved_with(tmp_path):
    """adamw-bf16's checkpoints hold bf16 masters and moments: optimizer.name auto resumes with it
    (the planner could otherwise pick fp32 AdamW on more GPUs), another name stops with one line."""
    from pathlib import Path

    from zerotrain.checkpoint import resume_stage
    from zerotrain.config import load_config

    config = Path(__file__).resolve().parents[2] / "examples" / "tiny-cpu.yaml"
    folder = make_checkpoint(tmp_path, 2)
    (folder / STATE).write_text(json.dumps({"step": 2, "world_size": 2, "zero_stage": 2, "optimizer": "adamw-bf16"}))
    assert resume_stage(load_config(config, ["optimizer.name=auto"]), folder).optimizer.name == "adamw-bf16"
    assert resume_stage(load_config(config, ["optimizer.name=adamw-bf16"]), folder).optimizer.name == "adamw-bf16"
    with pytest.raises(ZerotrainError, match="saved with optimizer adamw-bf16, this run asks for adamw; a checkpoint"):
        resume_stage(load_config(config, []), folder)


@pytest.mark.parametrize("optimizer", ["adamw-8bit", "adafactor"])
def test_a_client_optimizer_checkpoint_resumes_on_its_own_world_size_only(tmp_path, optimizer):
    """DeepSpeed's universal checkpoints know only its AdamW's per-parameter state: a bitsandbytes
    or Adafactor checkpoint resumes on the number of processes that saved it, and another number
    stops with one line before any conversion."""
    from zerotrain.checkpoint import needs_universal

    folder = make_checkpoint(tmp_path, 2)
    (folder / STATE).write_text(json.dumps({"step": 2, "world_size": 2, "zero_stage": 2, "optimizer": optimizer}))
    assert not needs_universal(folder, 2, 2)
    with pytest.raises(ZerotrainError, match=rf"saved by 2 process\(es\) with optimizer {optimizer}, whose state "
                                             r"DeepSpeed cannot convert for 4: .* Resume it on 2 GPU\(s\)"):
        needs_universal(folder, 4, 2)
