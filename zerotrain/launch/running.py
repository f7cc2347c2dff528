"""--run: the launcher as a child process, with the SIGTERM or SIGUSR1 this process gets passed
straight to the ranks."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import threading
from collections.abc import Mapping
from typing import Any


def run_forwarding_sigterm(command: list[str], env: Mapping[str, str]) -> int:
    """Run the launcher; a SIGTERM or SIGUSR1 this process gets goes straight to the ranks.

    As a container's main process (`docker stop`, a Kubernetes eviction), `zerotrain launch --run` is
    what receives SIGTERM. Passed to the launcher, it would reach the ranks too, but torchrun and the
    DeepSpeed launcher SIGKILL them 30 s later, which is too soon for a large checkpoint. Signalled
    directly, the ranks take faults.grace_seconds, exit 0, and the launcher then ends normally.
    Ctrl-C's SIGINT already reaches the whole process group; here it only must not end the wait."""
    proc = subprocess.Popen(command, env=dict(env))

    def forward(signum: int, _frame: Any) -> None:
        for target in rank_processes(proc.pid) or [proc]:
            with contextlib.suppress(ProcessLookupError, OSError):
                target.send_signal(signum)

    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            previous[sig] = signal.signal(sig, forward)
        previous[signal.SIGINT] = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        return proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def rank_processes(launcher_pid: int) -> list[Any]:
    """The ranks a launcher started: its descendants whose environment has LOCAL_RANK (torchrun and
    the DeepSpeed launcher set it for each rank) while their parent's has not (a data loader worker
    inherits it from its rank). Empty when none has started or psutil (a DeepSpeed dependency) is missing."""
    try:
        import psutil
    except ImportError:
        return []
    try:
        descendants = psutil.Process(launcher_pid).children(recursive=True)
    except psutil.Error:
        return []
    flagged = set()
    for process in descendants:
        with contextlib.suppress(psutil.Error):
            if "LOCAL_RANK" in process.environ():
                flagged.add(process.pid)
    ranks = []
    for process in descendants:
        with contextlib.suppress(psutil.Error):
            if process.pid in flagged and process.ppid() not in flagged:
                ranks.append(process)
    return ranks
