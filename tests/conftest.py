"""Shared test setup. Tiny CPU models run far faster single-threaded on the 2-core CI machine
(a tiny-sdxl forward: ~20 ms with 1 thread vs ~1.5 s with 2, measured).

DeepSpeed JIT-compiles its CPU ops (CPU Adam, FusedAdam, the shared-memory collectives, pinned
buffers: about 4 minutes on that machine; async I/O, 8 more) the first time a test needs them.
.ci/run compiles them before the tests (`zerotrain build-ops`, as the README's Quickstart does).
Where they are not built yet and the session has distributed tests, a background `zerotrain
build-ops` builds them into torch's extension cache while the unit and e2e tests run first
(pyproject's testpaths order) on the other core; a test that needs an op before it is built waits
on torch's build lock, and one whose op fails to build reports that itself, as it would without
this."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

_BUILD: list[subprocess.Popen] = []


def pytest_collection_finish(session: pytest.Session) -> None:
    if not any(item.get_closest_marker("distributed") for item in session.items):
        return
    code = "import os, sys\nos.nice(5)\nfrom zerotrain.cli import main\nsys.exit(main(['build-ops']))\n"
    _BUILD.append(subprocess.Popen(
        [sys.executable, "-c", code], env={**os.environ, "DS_ACCELERATOR": "cpu"},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))


def pytest_sessionfinish(session: pytest.Session) -> None:
    for proc in _BUILD:  # never left half-way: an interrupted build leaves torch's lock behind
        proc.wait()


@pytest.fixture(autouse=True)
def _single_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
