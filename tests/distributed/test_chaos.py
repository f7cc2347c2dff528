"""Real faults on two CPU ranks of the tiny example, each run compared with one uninterrupted run:

- repeated preemption: five SIGTERM-and-resume cycles at random steps at ZeRO-3 give per-step
  losses bit-identical to the uninterrupted run (the last checkpoint is then damaged by one flipped
  byte: the resume names the file and falls back to the one before); the signal goes to the rank
  processes here, and to the whole process group, DataLoader workers included, in test_preemption.py;
- kill -9 of one rank mid-step: the other rank names it and exits non-zero within a bounded time,
  never hangs; rerunning the same command resumes from the last complete checkpoint;
- kill -9 of every rank during a checkpoint write (before the model files, half-way through an
  optimizer file, just before `latest` moves): `latest` always names a complete, intact checkpoint;
- a real full disk (a small tmpfs): the run stops with one line and keeps the previous checkpoint;
  resuming in a roomy folder works.

Every rerun after a fault must reproduce the uninterrupted run's losses exactly, so a resume that
loaded the wrong state, or a half-written one, cannot pass.

The faults as real launchers and GPUs make them, beside this suite:
- test_preemption.py: the stop signal sent as Slurm and torchrun send it, to the whole process group with the
  DataLoader workers on (data.num_workers: 2): SIGTERM and SIGUSR1 to srun-style ranks, SIGINT to torchrun's;
- test_one_rank_oom.py: out-of-memory on one rank only (testing.oom_rank), half-way through the forward or the
  backward or in the optimizer step, at ZeRO 0-3 with and without overlap_comm, while the other rank waits in
  DeepSpeed's gathers and reductions: every rank stops within seconds with the failing rank's line;
  test_oom_recovery.py: on every rank at once, recovered;
- test_collective_timeout.py: a live rank that never joins (its data hangs) while the other waits in a
  reduction on DeepSpeed's own group: both stop after faults.collective_timeout_seconds with one line each,
  and a group made through DeepSpeed times out as the world group does.
"""

from __future__ import annotations

import dataclasses
import random
import shutil
import signal
import subprocess

import pytest

from tests.distributed.conftest import WORLD, Trainer, interrupted, logged_steps
from zerotrain.checkpoint import damage, tag_for
from zerotrain.distributed import Topology

pytestmark = pytest.mark.distributed

STEPS = 16  # room for five stops of 1-2 steps each, plus the steps a signal overtakes
COMMON = ("planner.offload=[none]", "training.mode=full", "training.resume=auto", "faults.lost_rank_seconds=5",
          "faults.collective_timeout_seconds=60")
GRACE_S = 60
ONE = Topology(0, 1, 0)  # the test process checks checkpoints alone


@pytest.fixture(scope="module")
def chaos(shared_cache, tmp_path_factory) -> Trainer:
    return Trainer(shared_cache, tmp_path_factory.mktemp("chaos"))


@pytest.fixture(scope="module")
def straight(chaos) -> dict[int, list[float]]:
    """The uninterrupted runs' per-step losses, by ZeRO stage (computed when first asked for)."""
    return {}


def uninterrupted(chaos: Trainer, straight: dict[int, list[float]], stage: int) -> list[float]:
    if stage not in straight:
        run = chaos(f"straight-{stage}", *COMMON, f"planner.stages=[{stage}]", f"training.max_steps={STEPS}",
                    "training.checkpoint_every=1000").check()
        straight[stage] = run.losses()
        assert len(straight[stage]) == STEPS
    return straight[stage]


def latest(output_dir) -> str:
    return (output_dir / "checkpoints" / "latest").read_text().strip()


def assert_intact(output_dir) -> None:
    """`latest` names a checkpoint whose files all match the checksums recorded when it was saved."""
    checkpoint = output_dir / "checkpoints" / latest(output_dir)
    assert (checkpoint / "zerotrain_state.json").is_file(), f"latest names an incomplete {checkpoint}"
    assert damage(checkpoint, ONE) is None


def flip_one_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_five_preemptions_give_the_uninterrupted_losses(chaos, straight):
    # ZeRO-3, the stage with the most to restore (partitioned parameters as well as optimizer
    # state); ZeRO-2's resume is exact too (kill -9 below, test_train_resume.py at ZeRO-1).
    stage = 3
    expected = uninterrupted(chaos, straight, stage)
    name = f"preempted-{stage}"
    overrides = (*COMMON, f"planner.stages=[{stage}]", f"training.max_steps={STEPS}",
                 "training.checkpoint_every=1000", f"faults.grace_seconds={GRACE_S}")
    rng = random.Random(stage)  # random stop steps, the same in every CI run
    done = 0
    for cycle in range(5):
        target = done + rng.randint(1, 2)
        stopped, seconds = interrupted(chaos, name, *overrides, after_steps=target,
                                       signals={rank: signal.SIGTERM for rank in range(WORLD)})
        assert stopped.returncodes == [0] * WORLD, stopped.tails()
        assert seconds < GRACE_S, f"exited {seconds:.0f} s after SIGTERM, grace {GRACE_S} s"
        done = logged_steps(stopped.output_dir)
        assert done >= target and latest(stopped.output_dir) == tag_for(done), (cycle, done, target)
        checkpoint = stopped.output_dir / "checkpoints" / tag_for(done)
        assert f"stopped by SIGTERM during step {done + 1}: checkpoint {checkpoint}" in stopped.log, stopped.tails()
        assert "resume with the same command" in stopped.log
        assert done < STEPS - 1, "the stops came too late to leave steps after them"

    if stage == 3:  # the newest checkpoint is damaged: the resume names the file and uses the one before
        checkpoints = chaos.tmp_path / name / "checkpoints"
        complete = sorted(p for p in checkpoints.glob("step-*") if (p / "zerotrain_state.json").is_file())
        newest, previous = complete[-1], complete[-2]
        victim = max((p for p in newest.iterdir() if p.is_file() and p.suffix == ".pt"), key=lambda p: p.stat().st_size)
        flip_one_byte(victim)
    resumed = chaos(name, *overrides).check()
    if stage == 3:
        assert f"checkpoint {newest} is damaged: {victim} does not match its SHA-256 checksum" in resumed.log, \
            resumed.tails()
        assert f"resuming from {previous}, the newest intact checkpoint" in resumed.log
        assert f"resumed from {previous} at step {int(previous.name[5:])}" in resumed.log
    assert [r["step"] for r in resumed.metrics()] == list(range(1, STEPS + 1))
    assert resumed.losses() == expected, (expected, resumed.losses())


def test_kill9_of_one_rank_is_named_and_the_rerun_resumes(chaos, straight):
    expected = uninterrupted(chaos, straight, 2)
    overrides = (*COMMON, "planner.stages=[2]", f"training.max_steps={STEPS}", "training.checkpoint_every=2")
    result, seconds = interrupted(chaos, "kill-one", *overrides, after_steps=5, signals={1: signal.SIGKILL})
    assert result.returncodes[1] == -signal.SIGKILL
    # 2: the collective failed at once and the heartbeat named the lost rank; 3: the rank was blocked
    # and the heartbeat thread ended it. Either way within a bounded time, with one line.
    assert result.returncodes[0] in (2, 3), result.tails()
    assert seconds < 45, f"the surviving rank took {seconds:.0f} s to stop (lost_rank_seconds 5)"
    errors = [line for line in result.log.splitlines() if line.startswith("zerotrain: error:")]
    assert len(errors) == 1 and "rank 1 was lost" in errors[0], result.tails()
    assert "Traceback" not in result.log
    assert_intact(result.output_dir)
    resumed_from = result.output_dir / "checkpoints" / latest(result.output_dir)

    rerun = chaos("kill-one", *overrides).check()
    assert f"resumed from {resumed_from}" in rerun.log
    assert [r["step"] for r in rerun.metrics()] == list(range(1, STEPS + 1))
    assert rerun.losses() == expected


def test_kill9_of_every_rank_during_checkpoint_writes(chaos, straight):
    """One run folder, killed in three checkpoint writes in turn, then finished: each time
    `latest` names an intact checkpoint, and the finished run has the uninterrupted losses."""
    expected = uninterrupted(chaos, straight, 2)
    overrides = (*COMMON, "planner.stages=[2]", f"training.max_steps={STEPS}", "training.checkpoint_every=2")
    checkpoints = chaos.tmp_path / "kill-all" / "checkpoints"
    for step, point, survivor in ((4, "before_model", "step-00000002"), (4, "optimizer", "step-00000002"),
                                  (6, "before_latest", "step-00000004")):
        killed = chaos("kill-all", *overrides, f"testing.kill={{step: {step}, point: {point}}}")
        assert -signal.SIGKILL in killed.returncodes and 0 not in killed.returncodes, killed.tails()
        assert latest(killed.output_dir) == survivor, point
        assert_intact(killed.output_dir)
        if point == "optimizer":  # the kill came half-way through the file
            name = next(checkpoints.glob("step-00000002/*zero_pp_rank_0_*optim_states.pt")).name  # rank 0 wrote it
            assert (checkpoints / "step-00000004" / name).stat().st_size < \
                (checkpoints / "step-00000002" / name).stat().st_size
            assert not (checkpoints / "step-00000004" / "zerotrain_state.json").exists()
        if point == "before_latest":  # complete on disk, but never named
            assert (checkpoints / "step-00000006" / "zerotrain_state.json").is_file()
    finished = chaos("kill-all", *overrides).check()
    assert f"resumed from {checkpoints / 'step-00000004'} at step 4" in finished.log
    assert [r["step"] for r in finished.metrics()] == list(range(1, STEPS + 1))
    assert finished.losses() == expected


def test_a_full_disk_stops_with_one_line_and_keeps_the_previous_checkpoint(chaos, straight, tmp_path):
    expected = uninterrupted(chaos, straight, 2)
    reference = chaos.tmp_path / "straight-2"
    checkpoint_bytes = sum(p.stat().st_size for p in (reference / "checkpoints").rglob("*") if p.is_file())
    run_bytes = sum(p.stat().st_size for p in reference.rglob("*") if p.is_file()
                    and "checkpoints" not in p.parts and "export" not in p.parts)
    # Room for the run's own files and one checkpoint and a half: the second checkpoint fills the disk.
    size = (run_bytes + checkpoint_bytes * 3 // 2) // 4096 * 4096 + 64 * 4096
    disk = tmp_path / "small-disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(disk)], check=False,
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root or CAP_SYS_ADMIN): {mounted.stderr.strip()}")
    try:
        full = chaos("full", *COMMON, "planner.stages=[2]", f"training.max_steps={STEPS}",
                     "training.checkpoint_every=4", f"output_dir={disk / 'run'}")
        assert full.returncodes == [2] * WORLD, full.tails()
        errors = [line for line in full.log.splitlines() if line.startswith("zerotrain: error:")]
        assert len(errors) == 1, full.tails()
        assert f"checkpoint {disk / 'run' / 'checkpoints' / 'step-00000008'} could not be written" in errors[0]
        assert f"{disk / 'run' / 'checkpoints' / 'step-00000004'} is still the latest checkpoint" in errors[0]
        assert "Traceback" not in full.log
        assert latest(disk / "run") == "step-00000004"
        assert not (disk / "run" / "checkpoints" / "step-00000008").exists(), "the partial checkpoint must go"
        assert_intact(disk / "run")
        roomy = tmp_path / "roomy"
        shutil.copytree(disk / "run", roomy)
    finally:
        subprocess.run(["umount", str(disk)], check=False)
    resumed = chaos("full", *COMMON, "planner.stages=[2]", f"training.max_steps={STEPS}",
                    "training.checkpoint_every=4", f"output_dir={roomy}").check()
    assert f"resumed from {roomy / 'checkpoints' / 'step-00000004'} at step 4" in resumed.log
    assert dataclasses.replace(resumed, output_dir=roomy).losses() == expected
