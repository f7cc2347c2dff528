"""Run zerotrain/train.py as a two-process DeepSpeed job on CPU (gloo), the way the DeepSpeed
launcher or torchrun would start it: one process per rank with RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR and MASTER_PORT set (a free port, so jobs never collide), DS_ACCELERATOR=cpu.
Starting the ranks here rather than through `deepspeed --num_gpus 2` saves the launcher's own
start (~2.5 s a run) and lets a test stop both ranks when one dies.

Every run starts from examples/tiny-cpu.yaml with --set overrides. The data cache (and with it
the tiny model folders under cache/models and the planner's measured facts) is one folder for the
whole session: the cache is content-addressed, so runs of different models or settings share it
safely, and each tiny model is built and each image encoded once."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "examples" / "tiny-cpu.yaml"
TINY_DATA = REPO / "examples" / "tiny-data"
WORLD = 2
# A tiny run takes 20-40 s on two cores (most of it imports, model load and deepspeed.initialize);
# the first offloaded run may JIT-compile DeepSpeed's CPU Adam (minutes, then cached).
TIMEOUT_S = 600


@dataclass
class TrainResult:
    output_dir: Path
    returncodes: list[int]
    logs: list[Path]
    seconds: float

    @property
    def ok(self) -> bool:
        return all(rc == 0 for rc in self.returncodes)

    def tails(self, chars: int = 4000) -> str:
        return "\n".join(f"--- rank {rank} ({log}) ---\n{log.read_text(errors='replace')[-chars:]}"
                         for rank, log in enumerate(self.logs))

    def check(self) -> TrainResult:
        assert self.ok, f"train.py exited with {self.returncodes} after {self.seconds:.0f} s:\n{self.tails()}"
        return self

    @property
    def log(self) -> str:
        """Rank 0's output (zerotrain prints its progress there)."""
        return self.logs[0].read_text(errors="replace")

    def metrics(self) -> list[dict]:
        path = self.output_dir / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def losses(self) -> list[float]:
        return [record["loss"] for record in self.metrics()]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_train(output_dir: Path, overrides: list[str], log_dir: Path, name: str,
              timeout: float = TIMEOUT_S) -> TrainResult:
    """Start WORLD ranks of train.py on examples/tiny-cpu.yaml + overrides and wait for them.
    A rank that exits non-zero leaves the others waiting in a collective: they are stopped."""
    log_dir.mkdir(parents=True, exist_ok=True)
    args = [sys.executable, "-u", str(REPO / "zerotrain" / "train.py"), "--config", str(CONFIG),
            "--set", f"output_dir={output_dir}"]
    for override in overrides:
        args += ["--set", override]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(WORLD),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    logs = [log_dir / f"{name}.rank{rank}.log" for rank in range(WORLD)]
    started = time.monotonic()
    procs = []
    for rank, log in enumerate(logs):
        with log.open("w") as out:
            procs.append(subprocess.Popen(args, env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                                          stdout=out, stderr=subprocess.STDOUT, cwd=log_dir))
    deadline = started + timeout
    while (any(p.poll() is None for p in procs) and time.monotonic() < deadline
           and not any(p.poll() not in (None, 0) for p in procs)):
        time.sleep(0.2)
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    returncodes = [proc.wait() for proc in procs]
    return TrainResult(output_dir, returncodes, logs, time.monotonic() - started)


@pytest.fixture(scope="session")
def shared_cache(tmp_path_factory) -> Path:
    """data.cache_dir for every training run of the session (planner facts under facts/), with the
    tiny model folders built here, in one process, as a single-process `zerotrain cache` would.
    (Built by the ranks themselves, a folder can come out without text encoder weights:
    transformers' save_pretrained writes only on rank 0 once torch.distributed is initialized.)"""
    from zerotrain.models.tiny import TINY_NAMES, ensure_tiny_pipeline

    cache = tmp_path_factory.mktemp("train_cache")
    for name in TINY_NAMES:
        ensure_tiny_pipeline(name, cache / "models")
    return cache


class Trainer:
    """train(name, *overrides) runs examples/tiny-cpu.yaml on two ranks with output_dir
    tmp_path/name, the shared cache, and the bundled images once each per epoch (8 samples);
    later overrides win. Returns a TrainResult (not checked: call .check())."""

    config = CONFIG
    world = WORLD

    def __init__(self, cache: Path, tmp_path: Path):
        self.tmp_path = tmp_path
        self.base = [f"data.cache_dir={cache}", f"planner.cache_dir={cache / 'facts'}",
                     f"data.datasets=[{{path: '{TINY_DATA}', repeats: 1}}]"]
        self.calls = 0

    def run_config(self, *overrides: str):
        """The RunConfig train.py sees for these overrides."""
        from zerotrain.config import load_config

        return load_config(CONFIG, [*self.base, *overrides])

    def __call__(self, name: str, *overrides: str, timeout: float = TIMEOUT_S) -> TrainResult:
        self.calls += 1
        return run_train(self.tmp_path / name, [*self.base, *overrides], self.tmp_path / "logs",
                         f"{self.calls}-{name}", timeout)


@pytest.fixture
def train(shared_cache, tmp_path) -> Trainer:
    return Trainer(shared_cache, tmp_path)
