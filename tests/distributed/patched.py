"""zerotrain/train.py as a user runs it, with a test's probe or fault installed in each rank first.

    python -m tests.distributed.patched zerotrain/train.py --config ... --set ...

imports the function named by ZEROTRAIN_TEST_PATCH ("module:function"), calls it, then runs
train.py as __main__ with the remaining arguments: the same code path, with what train.py cannot
show from outside (an engine's partitions, host copies on the CPU accelerator, a rank that hangs
with its heartbeat alive) added by the test. start() and run() launch it like conftest's ranks."""

from __future__ import annotations

import importlib
import os
import runpy
import sys
from pathlib import Path

PATCH_ENV = "ZEROTRAIN_TEST_PATCH"


def main() -> None:
    module, _, function = os.environ[PATCH_ENV].partition(":")
    getattr(importlib.import_module(module), function)()
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")


def args(train, name: str, *overrides: str) -> list[str]:
    """The command of train(name, *overrides) (conftest.Trainer) through this module."""
    from tests.distributed.conftest import train_args

    return [sys.executable, "-u", "-m", "tests.distributed.patched",
            *train_args(train.tmp_path / name, [*train.base, *overrides])]


def run(train, monkeypatch, patch: str, name: str, *overrides: str, world: int | None = None,
        timeout: float | None = None):
    """train(name, *overrides) with `patch` ("module:function") called in every rank first; a
    conftest.TrainResult (not checked)."""
    from tests.distributed.conftest import TIMEOUT_S, WORLD, TrainResult, run_ranks

    monkeypatch.setenv(PATCH_ENV, patch)
    train.calls += 1
    returncodes, logs, seconds = run_ranks(args(train, name, *overrides), train.tmp_path / "logs",
                                           f"{train.calls}-{name}", timeout or TIMEOUT_S, world or WORLD)
    return TrainResult(Path(train.tmp_path / name), returncodes, logs, seconds)


if __name__ == "__main__":
    main()
