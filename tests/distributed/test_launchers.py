"""train.py starts the same way under every launcher docs/training.md shows: DeepSpeed's launcher,
torchrun, Slurm's srun (ranks from SLURM_* only), and a plain single process. Each runs 2 steps
of the tiny CPU example and must report the world size it was started with."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.distributed.conftest import TIMEOUT_S, TrainResult, free_port, process_env, train_args

pytestmark = pytest.mark.distributed

STEPS = ("training.max_steps=2", "training.checkpoint_every=2", "planner.stages=[2]", "planner.offload=[none]")


def launch(command: list[str], output_dir: Path, log: Path) -> TrainResult:
    """Run one launcher command (it starts the ranks itself) and wait for it."""
    started = time.monotonic()
    env = {k: v for k, v in process_env().items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    with log.open("w") as out:
        rc = subprocess.run(command, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=log.parent,
                            timeout=TIMEOUT_S, check=False).returncode
    return TrainResult(output_dir, [rc], [log], time.monotonic() - started)


def check_world(result: TrainResult, world: int) -> None:
    result.check()
    plan = json.loads((result.output_dir / "plan.json").read_text())
    ds = json.loads((result.output_dir / "deepspeed.json").read_text())
    assert plan["world_size"] == world
    assert ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * world == ds["train_batch_size"]
    assert [r["step"] for r in result.metrics()] == [1, 2]
    assert (result.output_dir / "export" / "export.json").is_file()


@pytest.mark.parametrize("launcher", ["deepspeed", "torchrun", "python"])
def test_launcher(train, tmp_path, launcher):
    out = tmp_path / launcher
    args = train_args(out, [*train.base, *STEPS])
    port = str(free_port())
    command, world = {
        "deepspeed": ([str(Path(sys.executable).with_name("deepspeed")), "--num_gpus", "2", "--master_port", port,
                       *args], 2),
        "torchrun": ([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", port,
                      *args], 2),
        "python": ([sys.executable, *args], 1),
    }[launcher]
    tmp_path.joinpath("logs").mkdir()
    check_world(launch(command, out, tmp_path / "logs" / f"{launcher}.log"), world)


def test_srun(train):
    check_world(train("srun", *STEPS, slurm=True), 2)
