"""Ranks forked from one interpreter that has already imported torch, DeepSpeed, diffusers,
transformers and peft, instead of each rank importing them afresh.

A tiny two-rank run takes ~20 s, and ~13 s of each rank's CPU time is those imports: over the
suite's hundred-odd runs, on two cores, that is most of the distributed tests' time. Here one
multiprocessing forkserver imports them once (start() below); each rank is then a fork of it, a
separate OS process with its own pid, environment, working directory, stdout and stderr (its log),
exit code and signals, that runs the script as `python -u script.py args...` (or `-m module`)
would: runpy, as __main__, with sys.argv and sys.path[0] set as the interpreter sets them, the
atexit handlers run and the streams flushed at exit. What it does not repeat is the import, so the
fresh-interpreter start stays covered by the tests that launch through deepspeed, torchrun and the
zerotrain CLI (test_launchers, test_launch_recipes, tests/e2e), which start real interpreters.

A command this cannot run as the interpreter would (another executable, `-c`, options other than
-u) is started with subprocess.Popen, as is everything when ZEROTRAIN_TEST_FORK=0."""

from __future__ import annotations

import atexit
import io
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
import threading
from pathlib import Path

# Imported by the forkserver before it forks any rank: what every rank imports anyway.
PRELOAD = ["torch", "deepspeed", "diffusers", "diffusers.models.transformers", "transformers", "peft",
           "zerotrain.train"]
# Read by the preloaded libraries as they import, so the forkserver must start with them as every
# rank's environment has them (conftest.process_env). huggingface_hub reads its endpoint, cache and offline
# mode once, as diffusers imports it: a rank with other values (a test's local hub) starts a real interpreter.
IMPORT_TIME_ENV = ("DS_ACCELERATOR", "OMP_NUM_THREADS", "HF_ENDPOINT", "HF_HOME", "HF_HUB_CACHE", "HF_HUB_OFFLINE")

_context = None
_server_env: dict[str, str] = {}


def enabled() -> bool:
    return os.environ.get("ZEROTRAIN_TEST_FORK", "1") != "0" and sys.platform == "linux"


def start(env: dict[str, str]) -> None:
    """Start the forkserver (once a session) with env's import-time variables, and preload it."""
    global _context, _server_env
    if _context is not None or not enabled():
        return
    saved = {name: os.environ.get(name) for name in IMPORT_TIME_ENV}
    os.environ.update({name: env[name] for name in IMPORT_TIME_ENV if name in env})
    try:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(PRELOAD)
        # The server starts with the first process; this one loads the preloads and exits.
        warm = context.Process(target=_nothing)
        warm.start()
        warm.join()
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    _context = context
    _server_env = {name: env[name] for name in IMPORT_TIME_ENV if name in env}


def _nothing() -> None:
    pass


def runnable(args: list[str], env: dict[str, str]) -> tuple[str, str, list[str]] | None:
    """("path", script, argv) or ("module", name, argv) when `args` is `sys.executable [-u] script
    args...` or `sys.executable [-u] -m module args...` in an environment the forkserver matches;
    None otherwise."""
    if _context is None or not args or args[0] != sys.executable:
        return None
    if any(env.get(name) != _server_env.get(name) for name in IMPORT_TIME_ENV):
        return None
    rest = list(args[1:])
    if rest[:1] == ["-u"]:
        rest = rest[1:]
    if rest[:1] == ["-m"] and len(rest) >= 2:
        return "module", rest[1], rest[2:]
    if rest and not rest[0].startswith("-") and rest[0].endswith(".py"):
        return "path", rest[0], rest[1:]
    return None


class ForkedRank:
    """A rank forked from the forkserver, with what the tests use of subprocess.Popen: pid,
    poll(), wait(timeout), send_signal(), terminate(), kill(), returncode (negative: the signal
    that ended it, as Popen reports it)."""

    def __init__(self, process):
        self._process = process
        self.pid = process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(f"rank {self.pid}", timeout)
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        if self._process.exitcode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def popen(args: list[str], env: dict[str, str], log: Path, cwd: Path):
    """A ForkedRank running `args` where runnable() says it can, else subprocess.Popen, with stdout
    and stderr to `log` either way."""
    how = runnable(args, env)
    if how is None:
        with log.open("w") as out:
            return subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=cwd)
    kind, target, argv = how
    log.write_bytes(b"")  # there from the start, as Popen's would be
    process = _context.Process(target=_run, args=(kind, target, argv, env, str(log), str(cwd)))
    process.start()
    return ForkedRank(process)


def _run(kind: str, target: str, argv: list[str], env: dict[str, str], log: str, cwd: str) -> None:
    """In the forked rank: the environment, working directory and streams a fresh `python -u`
    would have, then the script as __main__, then what interpreter exit does."""
    fd = os.open(log, os.O_WRONLY)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True,
                                  errors="backslashreplace")
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    code: object = 0
    try:
        if kind == "path":
            sys.argv = [target, *argv]
            sys.path.insert(0, str(Path(target).resolve().parent))
            runpy.run_path(target, run_name="__main__")
        else:
            sys.argv = [target, *argv]
            sys.path.insert(0, cwd)
            runpy.run_module(target, run_name="__main__", alter_sys=True)
    except SystemExit as stop:
        code = stop.code
    except BaseException:  # noqa: BLE001  (what the interpreter does with an uncaught exception)
        sys.excepthook(*sys.exc_info())
        code = 1
    finally:
        # As the interpreter exits: wait for non-daemon threads, then the atexit handlers.
        threading._shutdown()
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    os._exit(code)
