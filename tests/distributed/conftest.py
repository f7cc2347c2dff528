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

from tests.distributed import forked

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "examples" / "tiny-cpu.yaml"
TINY_DATA = REPO / "examples" / "tiny-data"
WORLD = 2
# A tiny run takes 20-40 s on two cores (most of it imports, model load and deepspeed.initialize);
# the first offloaded run may JIT-compile DeepSpeed's CPU Adam (minutes, then cached).
TIMEOUT_S = 600
# faults.collective_timeout_seconds of the tests' runs: a stall ends with every rank's line, within TIMEOUT_S.
STALL_S = 240


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


def process_env() -> dict[str, str]:
    """The environment every test process runs in: CPU DeepSpeed, one thread, the repository importable."""
    return {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


def rank_env(rank: int, world: int, port: int, slurm: bool) -> dict[str, str]:
    """What a launcher sets for one rank: torchrun's and DeepSpeed's variables, or (slurm) what
    srun sets, with only MASTER_PORT added (a batch script exports it; zerotrain derives the rest)."""
    if slurm:
        return {"SLURM_PROCID": str(rank), "SLURM_NTASKS": str(world), "SLURM_LOCALID": str(rank),
                "SLURM_JOB_NODELIST": "localhost", "SLURM_JOB_ID": "1", "MASTER_PORT": str(port)}
    return {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port)}


def start_ranks(args: list[str], log_dir: Path, name: str, world: int = WORLD,
                slurm: bool = False) -> tuple[list[subprocess.Popen], list[Path]]:
    """Start `world` ranks of the command `args` as a launcher would (or as srun would, with
    slurm=True), each writing stdout and stderr to its log. Returns the processes and the logs."""
    log_dir.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in process_env().items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") and not k.startswith("SLURM_")}
    port = free_port()
    logs = [log_dir / f"{name}.rank{rank}.log" for rank in range(world)]
    procs = [forked.popen(args, {**env, **rank_env(rank, world, port, slurm)}, log, log_dir)
             for rank, log in enumerate(logs)]
    return procs, logs


def run_ranks(args: list[str], log_dir: Path, name: str, timeout: float = TIMEOUT_S,
              world: int = WORLD, slurm: bool = False, patience: float = 15) -> tuple[list[int], list[Path], float]:
    """start_ranks, and wait for them. A rank that exits non-zero may leave the others waiting in a
    collective: they are stopped `patience` seconds later. Returns the exit codes, each rank's log and the
    seconds taken."""
    started = time.monotonic()
    procs, logs = start_ranks(args, log_dir, name, world, slurm)
    deadline = started + timeout
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if any(p.poll() not in (None, 0) for p in procs):  # the others get a moment to fail on their own
            deadline = min(deadline, time.monotonic() + patience)
        time.sleep(0.2)
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    return [proc.wait() for proc in procs], logs, time.monotonic() - started


def train_args(output_dir: Path, overrides: list[str]) -> list[str]:
    """train.py's arguments for examples/tiny-cpu.yaml + overrides."""
    args = [str(REPO / "zerotrain" / "train.py"), "--config", str(CONFIG), "--set", f"output_dir={output_dir}"]
    for override in overrides:
        args += ["--set", override]
    return args


def run_train(output_dir: Path, overrides: list[str], log_dir: Path, name: str,
              timeout: float = TIMEOUT_S, world: int = WORLD, slurm: bool = False) -> TrainResult:
    """`world` ranks of train.py on examples/tiny-cpu.yaml + overrides."""
    args = [sys.executable, "-u", *train_args(output_dir, overrides)]
    returncodes, logs, seconds = run_ranks(args, log_dir, name, timeout, world, slurm)
    return TrainResult(output_dir, returncodes, logs, seconds)


@pytest.fixture(scope="session", autouse=True)
def deepspeed_cpu_ops_built(request) -> None:
    """Build DeepSpeed's CPU ops once, in one process, before any test starts ranks (`zerotrain
    build-ops`, which .ci/run has run already: then this finds them built). Left to the ranks, they
    build together behind one lock file, and a rank a test kills while it builds leaves that lock
    behind, so every later process that loads the op waits on it: in a fresh CI clone, fused_adam's
    build never finished and a calibrate run waited until its timeout. An op that cannot build here
    is left to the tests (those with offload skip, saying why). A session of gpu-marked tests only
    (benchmarks/gpu_check.py on a GPU node, minutes counted) runs on CUDA: no CPU op, no forkserver."""
    if request.session.items and all(item.get_closest_marker("gpu") for item in request.session.items):
        return
    subprocess.run([sys.executable, "-m", "zerotrain.cli", "build-ops"], env=process_env(), check=False,
                   capture_output=True, timeout=TIMEOUT_S)
    forked.start(process_env())


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


def tiny_data(cache: Path) -> list[str]:
    """Overrides for a run on the bundled images (once each per epoch: 8 samples) with the data
    cache, the tiny model folders and the planner's facts under `cache`."""
    return [f"data.cache_dir={cache}", f"planner.cache_dir={cache / 'facts'}",
            f"data.datasets=[{{path: '{TINY_DATA}', repeats: 1}}]"]


class Trainer:
    """train(name, *overrides) runs examples/tiny-cpu.yaml on two ranks with output_dir
    tmp_path/name, the shared cache, the bundled images once each per epoch (8 samples), and
    ZeRO-3 partitioning every parameter;
    later overrides win; world= sets the number of ranks. Returns a TrainResult (not checked: call
    .check())."""

    config = CONFIG
    world = WORLD

    def __init__(self, cache: Path, tmp_path: Path):
        self.tmp_path = tmp_path
        # Every tiny parameter is below ZeRO-3's default persistence threshold (100k elements), which
        # would keep them all whole on every rank: with 0, ZeRO-3 runs partition and gather for real.
        # A rank stalled in a phase of the loop (a tiny run's take seconds) ends itself, naming where every rank
        # is, long before the test's own limit (TIMEOUT_S) would kill it without a word.
        self.base = [*tiny_data(cache), "planner.stage3_param_persistence_threshold=0",
                     f"faults.collective_timeout_seconds={STALL_S}"]
        self.calls = 0

    def run_config(self, *overrides: str):
        """The RunConfig train.py sees for these overrides."""
        from zerotrain.config import load_config

        return load_config(CONFIG, [*self.base, *overrides])

    def __call__(self, name: str, *overrides: str, timeout: float = TIMEOUT_S, world: int = WORLD,
                 slurm: bool = False) -> TrainResult:
        self.calls += 1
        return run_train(self.tmp_path / name, [*self.base, *overrides], self.tmp_path / "logs",
                         f"{self.calls}-{name}", timeout, world, slurm)


@pytest.fixture
def train(shared_cache, tmp_path) -> Trainer:
    return Trainer(shared_cache, tmp_path)


def logged_steps(output_dir: Path) -> int:
    """How many step records rank 0 has written to metrics.jsonl so far."""
    path = output_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.is_file() else 0


def interrupted(train: Trainer, name: str, *overrides: str, after_steps: int, signals: dict[int, int],
                wait_s: float = 150) -> tuple[TrainResult, float]:
    """Start train(name, *overrides)'s ranks, wait until metrics.jsonl holds `after_steps` records,
    send signals[rank] to those ranks (SIGTERM to all, as Slurm does; SIGKILL to one, as a crash
    does), and wait up to wait_s for every rank to exit (stragglers are killed and reported as
    None). Returns the result and the seconds from the signal to the last exit."""
    train.calls += 1
    out = train.tmp_path / name
    args = [sys.executable, "-u", *train_args(out, [*train.base, *overrides])]
    procs, logs = start_ranks(args, train.tmp_path / "logs", f"{train.calls}-{name}")
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline and all(p.poll() is None for p in procs) and logged_steps(out) < after_steps:
        time.sleep(0.05)
    if not all(p.poll() is None for p in procs):
        for proc in procs:
            proc.kill()
        raise AssertionError("a rank ended before it could be signalled:\n" +
                             "\n".join(log.read_text(errors="replace")[-3000:] for log in logs))
    signalled = time.monotonic()
    for rank, sig in signals.items():
        procs[rank].send_signal(sig)
    returncodes: list = []
    for proc in procs:
        try:
            returncodes.append(proc.wait(timeout=max(0.1, signalled + wait_s - time.monotonic())))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            returncodes.append(None)
    return TrainResult(out, returncodes, logs, time.monotonic() - signalled), time.monotonic() - signalled
