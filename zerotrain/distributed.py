"""Where this process sits in a distributed job, from what the launchers set: torchrun and the
DeepSpeed launcher (RANK, WORLD_SIZE, LOCAL_RANK), or Slurm's srun (SLURM_PROCID, SLURM_NTASKS,
SLURM_LOCALID), and the rendezvous a plain `python zerotrain/train.py` lacks. zerotrain's other
modules ask this one: doctor compares its launcher view (local_world_size) with the GPUs, and
zerotrain/launch/ writes these variables into the commands and scripts it generates for the launchers."""

from __future__ import annotations

import functools
import gc
import os
import socket
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from zerotrain.errors import ZerotrainError


@dataclass(frozen=True)
class Topology:
    rank: int
    world_size: int
    local_rank: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def topology(environ: Mapping[str, str] | None = None) -> Topology:
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return Topology(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)))
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return Topology(int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", 0)))
    return Topology(0, 1, 0)


def local_world_size(environ: Mapping[str, str] | None = None) -> int | None:
    """Processes on this node, as torchrun (LOCAL_WORLD_SIZE) or Open MPI (LOCAL_SIZE) say; None when
    no launcher says."""
    env = os.environ if environ is None else environ
    value = env.get("LOCAL_WORLD_SIZE") or env.get("LOCAL_SIZE")
    return int(value) if value else None


def standalone_rendezvous() -> None:
    """A plain `python zerotrain/train.py` has no launcher: act as a one-process launcher and
    set the rendezvous variables one would set, on a free local port (otherwise DeepSpeed falls
    back to MPI discovery)."""
    if "MASTER_ADDR" in os.environ:
        return
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1",
                       "LOCAL_RANK": "0"})


def slurm_rendezvous(environ: MutableMapping[str, str] | None = None) -> None:
    """Under Slurm's srun (SLURM_PROCID and SLURM_NTASKS, no RANK), set the variables torch and
    DeepSpeed read: RANK, WORLD_SIZE and LOCAL_RANK from SLURM_*, MASTER_ADDR (when not set) the
    first host of SLURM_JOB_NODELIST, MASTER_PORT (when not set) 20000 + SLURM_JOB_ID % 20000, so
    that jobs sharing a node do not collide. Anything already set is kept."""
    env = os.environ if environ is None else environ
    if "RANK" in env or "SLURM_PROCID" not in env or "SLURM_NTASKS" not in env:
        return
    env["RANK"], env["WORLD_SIZE"] = env["SLURM_PROCID"], env["SLURM_NTASKS"]
    env.setdefault("LOCAL_RANK", env.get("SLURM_LOCALID", "0"))
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if "MASTER_ADDR" not in env and nodelist:
        env["MASTER_ADDR"] = first_host(nodelist)
    env.setdefault("MASTER_PORT", str(20000 + int(env.get("SLURM_JOB_ID", "0") or 0) % 20000))


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list: "gpu[03-05,09],cpu1" -> "gpu03"."""
    head = nodelist.strip()
    depth = 0
    for i, char in enumerate(head):
        depth += char == "["
        depth -= char == "]"
        if char == "," and depth == 0:
            head = head[:i]
            break
    if "[" not in head:
        return head
    prefix, _, ranges = head.partition("[")
    first = ranges.rstrip("]").split(",")[0].split("-")[0]
    return prefix + first + head[head.index("]") + 1:]


@functools.cache
def accelerator() -> tuple[str, str]:
    """The device type and collective backend of the accelerator DeepSpeed selected: DS_ACCELERATOR
    when set, otherwise DeepSpeed's detection ('cuda' and 'nccl' on an NVIDIA node). zerotrain's
    own tensors follow it, so a run (or a test) with DS_ACCELERATOR=cpu stays on the CPU and gloo
    on a GPU machine too, instead of asking for cuda:<local_rank> on a node with fewer GPUs."""
    from deepspeed.accelerator import get_accelerator

    selected = get_accelerator()
    return selected.device_name(), selected.communication_backend_name()


def device_index(local_rank: int, visible: int, environ: Mapping[str, str] | None = None) -> int:
    """Which of the GPUs this process sees is its own: the node-local rank's where it sees the node's GPUs; the
    one it sees where each task sees only its own (Slurm's --gpus-per-task=1 or --gpu-bind, one container per
    GPU), whatever its local rank; one line, with both numbers, where it sees fewer than its local rank needs
    ("invalid device ordinal" otherwise)."""
    if local_rank < visible:
        return local_rank
    if visible == 1:
        return 0
    env = os.environ if environ is None else environ
    mask = env.get("CUDA_VISIBLE_DEVICES")
    raise ZerotrainError(
        f"LOCAL_RANK={local_rank}, but this process sees {visible} GPU{'s' if visible != 1 else ''}"
        f"{f' (CUDA_VISIBLE_DEVICES={mask})' if mask is not None else ''}: a node-local rank needs the node's GPUs, "
        "or exactly one of its own; launch one task per GPU with every GPU visible to it (DeepSpeed: --include, "
        "not CUDA_VISIBLE_DEVICES), or bind exactly one GPU to each task (srun --gpus-per-task=1)")


def local_device(topo: Topology) -> torch.device:
    """This process's device on DeepSpeed's accelerator: on GPUs, cuda:<device_index>, the local rank's or the
    one GPU a task sees; cpu otherwise."""
    kind, _ = accelerator()
    if kind == "cpu":
        return torch.device("cpu")
    return torch.device(kind, device_index(topo.local_rank, torch.cuda.device_count()) if kind == "cuda"
                        else topo.local_rank)


def use_device(topo: Topology) -> torch.device:
    """Make this process's accelerator device current (before any collective: NCCL uses the current device),
    tell DeepSpeed which it is, and return it. DeepSpeed takes its device from LOCAL_RANK (its engine, zero.Init,
    ZeRO's buffers), so where each task sees one GPU of its own, LOCAL_RANK becomes that GPU's index, 0; the
    node-local rank stays topo.local_rank, for what zerotrain does once per node."""
    device = local_device(topo)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        if device.index != topo.local_rank:
            os.environ["LOCAL_RANK"] = str(device.index)
    return device


def init_process_group(topo: Topology, timeout: float | None = None) -> None:
    """Join the job's process group (the accelerator's backend: NCCL on GPUs, gloo on CPU) when
    there is more than one process, with `timeout` seconds for its collectives (torch's default when None).
    MASTER_ADDR/MASTER_PORT come from the launcher."""
    from datetime import timedelta

    if topo.world_size > 1 and not torch.distributed.is_initialized():
        use_device(topo)
        torch.distributed.init_process_group(accelerator()[1], rank=topo.rank, world_size=topo.world_size,
                                             **({} if timeout is None else {"timeout": timedelta(seconds=timeout)}))


def barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def patient_barrier(what: str) -> None:
    """A barrier after one rank's long work (a node's download, a share of the cache build, a checkpoint's
    conversion), which may outlast any collective timeout (20 GB of encoders): the ranks meet in the rendezvous
    store, with no deadline while every rank's heartbeat moves (a lost rank ends the wait: Heartbeat), instead
    of in a collective. The plain barrier where no heartbeat runs."""
    heartbeat = CURRENT
    if heartbeat is None or heartbeat._store is None:
        barrier()
        return
    with PROGRESS.during(f"wait for {what}", watched=False):
        heartbeat.barriers += 1  # every rank of the job counts its barriers alike
        heartbeat.everyone(f"barrier/{heartbeat.barriers}", float("inf"))


def gather_objects(value: object) -> list[object]:
    """Every rank's value, on every rank (a list of one without a process group)."""
    if not torch.distributed.is_initialized():
        return [value]
    out: list[object] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, value)
    return out


T = TypeVar("T")


def _attempt(compute: Callable[..., Any], args: tuple, topo: Topology) -> tuple[object, Exception | None]:
    """(compute(*args), None), or (what the other ranks raise, the error) where it failed: the error itself
    when it is a ZerotrainError, else a ZerotrainError naming it and this rank."""
    try:
        return compute(*args), None
    except Exception as err:  # noqa: BLE001 - the other ranks must not wait for a result that will not come
        return (err if isinstance(err, ZerotrainError) else ZerotrainError(
            f"{getattr(compute, '__name__', 'a step')} failed on rank {topo.rank}: {err}")), err


def from_rank0(compute: Callable[..., T], topo: Topology, *args: Any) -> T:
    """compute(*args) on rank 0, its result broadcast to every rank (so every rank uses the same
    plan even when nodes report different free memory). An error on rank 0 is raised on every rank:
    rank 0's own, and a ZerotrainError naming it on the others."""
    outcome, error = _attempt(compute, args, topo) if topo.is_main else (None, None)
    if torch.distributed.is_initialized() and topo.world_size > 1:
        box = [outcome]
        torch.distributed.broadcast_object_list(box, src=0)
        outcome = box[0]
    if error is not None:
        raise error
    if isinstance(outcome, ZerotrainError):
        raise outcome
    return outcome  # type: ignore[return-value]


def on_each_node(compute: Callable[..., T], topo: Topology, *args: Any) -> T:
    """compute(*args) on local rank 0 of every node (a download into the node's cache) while the node's
    other ranks wait (patient_barrier: as long as it takes, while it is alive); each rank gets its node's result.
    An error on any node is raised on every rank: the computing rank's own error, and its one line on the
    others."""
    outcome, error = _attempt(compute, args, topo) if topo.local_rank == 0 else (None, None)
    patient_barrier(f"{getattr(compute, '__name__', 'a step')} on local rank 0 of each node")
    host = socket.gethostname()
    everyone = gather_objects((host, topo.local_rank, outcome))
    if error is not None:
        raise error
    failed = [value for _, _, value in everyone if isinstance(value, ZerotrainError)]
    if failed:
        raise failed[0]
    mine = [value for name, local, value in everyone if name == host and local == 0]
    if not mine:
        raise ZerotrainError(f"rank {topo.rank}: no rank of this node ({host}) has local rank 0; check LOCAL_RANK")
    return mine[0]  # type: ignore[return-value]


def agree(values: list[float]) -> list[float]:
    """The element-wise maximum of `values` over all ranks (one small all-reduce; the values
    themselves without a process group). Every rank must call it at the same point."""
    if not torch.distributed.is_initialized():
        return list(values)
    device = "cpu"
    if torch.distributed.get_backend() == "nccl":
        device = f"cuda:{torch.cuda.current_device()}"
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
    return tensor.tolist()


def all_ok(ok: bool) -> bool:
    """Whether every rank says ok (see agree)."""
    return agree([0.0 if ok else 1.0])[0] == 0.0


class Progress:
    """What this rank's main thread is doing, for its heartbeat thread: a phase ("forward", "checkpoint"), the
    optimizer step it belongs to, and since when. A watched phase that lasts longer than the collective
    timeout is a stall (Heartbeat); an unwatched one (a download or a cache build other ranks wait for
    patiently, patient_barrier) has no limit. Setting it is an attribute assignment: the loop sets it at every
    phase."""

    def __init__(self) -> None:
        import time

        self.step: int | None = None
        self.state: tuple[str | None, float, bool, int | None] = (None, time.time(), False, None)

    def at(self, phase: str | None, watched: bool = True) -> None:
        import time

        self.state = (phase, time.time(), watched, self.step)

    def during(self, phase: str, watched: bool = True) -> Any:
        """A context in `phase`; the phase before it resumes after (from then on)."""
        import contextlib
        import time

        @contextlib.contextmanager
        def scope() -> Any:
            before = self.state
            self.at(phase, watched)
            try:
                yield
            finally:
                self.state = (before[0], time.time(), before[2], before[3])

        return scope()

    @staticmethod
    def describe(state: tuple[str | None, float, bool, int | None]) -> str:
        phase, _, _, step = state
        if phase is None:
            return "start-up"
        return f"the {phase} of step {step}" if step is not None and phase in STEP_PHASES else f"the {phase}"

    @staticmethod
    def order(state: tuple[str | None, float, bool, int | None]) -> tuple[int, int]:
        """How far a rank in this state has got: its step, then its phase's place in the step (a rank behind the
        others is the one they wait for)."""
        phase, _, _, step = state
        return (step or 0, PHASE_ORDER.index(phase) if phase in PHASE_ORDER else -1)


# Phases of one optimizer step, named with the step's number, and the loop's phases in their order.
STEP_PHASES = ("data", "forward", "backward", "optimizer step", "agreement", "EMA update")
PHASE_ORDER = (*STEP_PHASES, "checkpoint", "validation")
PROGRESS = Progress()
# The job's one fault line: the first rank to post one (Heartbeat.post) stops every rank with it.
FAULT_KEY = "zerotrain/fault"


class Heartbeat:
    """Tells which rank of a job was lost or stalled, or ran into a fault of its own, and ends a rank that would
    otherwise wait for it until a timeout.

    A background thread of every rank advances the counter zerotrain/heartbeat/<rank> in the job's
    rendezvous store (its own TCPStore client of MASTER_ADDR:MASTER_PORT, held by rank 0 or by
    torchrun's agent) once a second, and reads the others'. A rank whose counter has not moved for
    `lost_after` seconds (the process was killed, its node went down), or a store that stays
    unreachable that long (the process holding it ended), is lost. The main thread learns it from
    `verdict()` after a collective failed (gloo fails at once when a peer's socket closes); when the
    main thread stays blocked instead (NCCL waits until the collective timeout), the thread prints
    the one line itself and ends the process with exit code 3 after `handover` seconds.

    The same thread
    - publishes the main thread's phase (PROGRESS) under zerotrain/phase/<rank>, so that a line names where each
      rank is;
    - ends the rank, with exit code 3 and one line naming every rank's phase, when a watched phase has lasted
      `stall_after` seconds (faults.collective_timeout_seconds): a collective that never completes, on any group,
      DeepSpeed's included, whatever the backend. The process groups' own timeout is set longer
      (deepspeed_compat.init_distributed), so that this line, not NCCL's watchdog abort, is what a user reads;
    - reads the job's fault line (FAULT_KEY): a rank that cannot go on (one rank out of memory) posts it before it
      stops, and every other rank, wherever it waits, stops with it (as with a lost rank: verdict(), or the
      thread itself after `handover` seconds).

    The counters live in the store, not in the collectives, so they keep moving while a rank is
    busy: compute, a checkpoint write or a universal conversion release the GIL. `stop()` ends the
    thread and the store client before the process group is destroyed."""

    EXIT_CODE = 3

    def __init__(self, topo: Topology, lost_after: float, interval: float = 1.0, handover: float = 15.0,
                 environ: Mapping[str, str] | None = None, stall_after: float | None = None,
                 progress: Progress = PROGRESS, resume: Callable[[], str] | None = None):
        import threading

        self.topo = topo
        self.resume = resume or (lambda: "resume with the same command (training.resume: auto)")
        self.lost_after = lost_after
        self.interval = interval
        self.handover = handover
        self.stall_after = stall_after
        self.progress = progress
        self.lost: list[int] | None = None
        self.fault: str | None = None
        self.barriers = 0  # patient_barrier's, in this job
        self.detail = ""
        self._found = threading.Event()
        self._handled = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._store = None
        env = os.environ if environ is None else environ
        if topo.world_size > 1 and "MASTER_ADDR" in env and "MASTER_PORT" in env:
            import sys
            from datetime import timedelta

            try:
                self._store = torch.distributed.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]),
                                                         is_master=False, wait_for_workers=False,
                                                         timeout=timedelta(seconds=max(1.0, interval * 5)))
            except (RuntimeError, ValueError) as err:  # the job trains on; only the naming of a lost rank is lost
                print(f"zerotrain: warning: rank {topo.rank}: no heartbeat through the rendezvous store "
                      f"{env['MASTER_ADDR']}:{env['MASTER_PORT']} ({' '.join(str(err).split())[:160]}); a lost rank "
                      "will be noticed only by faults.collective_timeout_seconds", file=sys.stderr, flush=True)
                return
            global CURRENT
            CURRENT = self
            self._thread = threading.Thread(target=self._run, name="zerotrain-heartbeat", daemon=True)
            self._thread.start()

    def _key(self, rank: int) -> str:
        return f"zerotrain/heartbeat/{rank}"

    def _run(self) -> None:
        import time

        others = [r for r in range(self.topo.world_size) if r != self.topo.rank]
        seen = {r: -1 for r in others}
        moved = {r: time.monotonic() for r in others}
        reachable = time.monotonic()
        published = snapshot = None
        while not self._stop.wait(self.interval):
            now = time.monotonic()
            state = self.progress.state
            try:
                self._store.add(self._key(self.topo.rank), 1)
                for r in others:
                    count = self._store.add(self._key(r), 0)
                    if count != seen[r]:
                        seen[r], moved[r] = count, now
                if state != published:
                    step, place = Progress.order(state)
                    self._store.set(f"zerotrain/phase/{self.topo.rank}",
                                    f"{step}\t{place}\t{state[1]}\t{Progress.describe(state)}")
                    published = state
                fault = self._store.get(FAULT_KEY).decode() if self._store.check([FAULT_KEY]) else None
                reachable = now
            except Exception as err:  # noqa: BLE001 - any store failure means its holder is gone
                if now - reachable >= self.lost_after:
                    self._declare([0], f"the rendezvous store at rank 0 has been unreachable for "
                                       f"{now - reachable:.0f} s ({' '.join(str(err).split())[:120]})")
                    return
                continue
            if fault is not None and not fault.startswith(f"{self.topo.rank}\t"):
                self._declare([], "", fault=fault.partition("\t")[2])
                return
            lost = [r for r in others if now - moved[r] >= self.lost_after]
            if lost:
                self._declare(lost, f"no heartbeat for {self.lost_after:.0f} s")
                return
            phase, since, watched, _ = state
            if self.stall_after is None or not watched or phase is None:
                continue
            if snapshot is None or snapshot[0] != state:
                snapshot = (state, None)
            if time.time() - since >= self.stall_after / 2 and snapshot[1] is None:
                # Where the others are, read while they are all alive: the stalled ranks end together, and the
                # store ends with rank 0's process.
                snapshot = (state, self._phases())
            if time.time() - since >= self.stall_after:
                self._stalled(state, snapshot[1] or {})
                return

    def _declare(self, lost: list[int], detail: str, fault: str | None = None) -> None:
        import sys

        self.lost, self.detail, self.fault = lost, detail, fault
        self._found.set()
        if self._handled.wait(self.handover) or self._stop.is_set():
            return
        print(f"zerotrain: error: rank {self.topo.rank}: {self.describe()}; stopping this rank (it was blocked "
              f"in {Progress.describe(self.progress.state)}); {self.resume()}", file=sys.stderr, flush=True)
        os._exit(self.EXIT_CODE)

    def _phases(self) -> dict[int, tuple[tuple[int, int], float, str]]:
        """The other ranks' published phases (their order, since when, in words); those that cannot be read are
        left out."""
        import contextlib

        found = {}
        for r in range(self.topo.world_size):
            # A rank that never published, or a store gone: left out.
            with contextlib.suppress(Exception):
                if r != self.topo.rank:
                    step, place, since, phase = self._store.get(f"zerotrain/phase/{r}").decode().split("\t", 3)
                    found[r] = ((int(step), int(place)), float(since), phase)
        return found

    def _stalled(self, state: tuple[str | None, float, bool, int | None],
                 earlier: dict[int, tuple[tuple[int, int], float, str]]) -> None:
        """The line of a rank whose watched phase outlasted stall_after: where every rank is (as the store says now,
        else as it said half-way, `earlier`), which one the others wait for (the one behind: an earlier step or
        phase), and what to check."""
        import sys
        import time

        now, mine = time.time(), (Progress.order(state), state[1], Progress.describe(state))
        known = {**earlier, **self._phases(), self.topo.rank: mine}
        behind = min(order for order, _, _ in known.values())
        late = sorted(r for r, (order, _, _) in known.items() if order == behind)
        unknown = [r for r in range(self.topo.world_size) if r not in known]
        others = "; ".join([f"rank {r} in {phase} for {now - since:.0f} s" for r, (_, since, phase) in sorted(known.items())
                            if r != self.topo.rank and phase != mine[2]]
                           + [f"rank {r} in an unknown phase" for r in unknown[:4]])
        if len(known) == 1:
            check = "where the other ranks are cannot be read (the store has gone): look at their own lines"
        elif len(late) == len(known) and not unknown:
            check = ("every rank waits in the same phase: a collective that never completes; check the network "
                     "between the nodes (NCCL_DEBUG=INFO)")
        elif self.topo.rank in late:
            check = f"the other ranks wait for this one: look at what it does in {mine[2]} (py-spy dump --pid)"
        else:
            check = (f"rank {late[0]} is behind, in {known[late[0]][2]}: look at what it does there (py-spy dump "
                     "--pid of its process)")
        print(f"zerotrain: error: rank {self.topo.rank}: no progress for {now - state[1]:.0f} s in {mine[2]} "
              f"(faults.collective_timeout_seconds={self.stall_after:g}){'; ' + others if others else ''}; {check}; "
              f"stopping this rank; {self.resume()}", file=sys.stderr, flush=True)
        os._exit(self.EXIT_CODE)

    def describe(self) -> str:
        if self.fault:
            return self.fault
        if not self.lost:
            return "a collective failed, but every rank's heartbeat is still moving"
        ranks = ", ".join(str(r) for r in self.lost)
        return f"rank {ranks} was lost ({self.detail}: its process ended or its node went down)"

    def verdict(self, wait: float | None = None) -> list[int] | str | None:
        """The lost ranks, or the fault line another rank posted, waiting up to `wait` seconds (default: long
        enough for a verdict) for the thread to reach one; None if every rank is still alive and none posted a
        fault. The caller then handles it: the thread no longer ends the process."""
        self._handled.set()
        if self._thread is not None:
            self._found.wait(self.lost_after + 3 * self.interval if wait is None else wait)
        return self.fault or self.lost

    def post(self, line: str) -> None:
        """This rank cannot go on: `line` (naming the rank and the phase) becomes the job's fault line unless
        another rank's came first, and every other rank stops with it."""
        import contextlib

        if self._store is not None:  # without the store, the others stop at their collective's failure
            with contextlib.suppress(Exception):
                self._store.compare_set(FAULT_KEY, "", f"{self.topo.rank}\t{line}")

    def everyone(self, key: str, within: float) -> bool:
        """Whether every rank reaches `key` (each calls this with it) within `within` seconds of this rank: a rank
        that ran out of memory asks whether the others did too, in the same step. True without a store (one
        rank)."""
        import time

        if self._store is None:
            return True
        deadline, pause = time.monotonic() + within, 0.02
        arrived = self._store.add(f"zerotrain/arrive/{key}", 1)
        while arrived < self.topo.world_size and time.monotonic() < deadline:
            time.sleep(pause)
            pause = min(1.0, pause * 1.5)  # a long wait asks the store once a second
            arrived = self._store.add(f"zerotrain/arrive/{key}", 0)
        return arrived >= self.topo.world_size

    def stop(self) -> None:
        global CURRENT
        if CURRENT is self:
            CURRENT = None
        self._handled.set()
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval * 10)
        self._thread = None
        self._store = None


# The running heartbeat of this process (None: one rank, or no store).
CURRENT: Heartbeat | None = None


def shutdown(clean: bool, heartbeat: Heartbeat | None = None) -> None:
    """Leave the process group while the interpreter is fully alive. Without this, gloo's worker
    threads may still hold finished work (tensors that own Python objects: DeepSpeed tags its
    tensors with attributes) when the interpreter finalizes; releasing them then needs the GIL, the
    thread is made to exit, and the process aborts with "terminate called without an active
    exception" (exit -6) after its work was done (benchmarks/gloo_exit_abort.py reproduces it;
    pytorch#190489, #179291).
    clean: every rank got here together, so a last barrier makes sure none is still inside a
    collective of this group (the heartbeat still runs during it, so a rank lost there is named);
    after an error on some ranks only, no barrier (it would wait for the collective timeout)."""
    import sys

    try:
        if clean and torch.distributed.is_initialized():
            try:
                torch.distributed.barrier()
            except RuntimeError as err:  # a rank that finished its work was lost on its way out
                lost = heartbeat.verdict() if heartbeat is not None else None
                print(f"zerotrain: warning: the last barrier failed ({heartbeat.describe() if lost else err}); "
                      "this rank's work is complete", file=sys.stderr, flush=True)
    finally:
        if heartbeat is not None:
            heartbeat.stop()
        if torch.distributed.is_initialized():
            # DeepSpeed engines are reference cycles that hold their process groups: unless collected
            # now, a group's gloo threads live on until the interpreter finalizes and abort it there
            # (a test worker that built five engines did, once in a few runs, even after the destroy).
            gc.collect()
            torch.distributed.destroy_process_group()
            gc.collect()
