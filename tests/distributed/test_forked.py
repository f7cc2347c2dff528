"""The forked ranks (tests/distributed/forked.py) behave as the `python -u script.py` processes they
stand for: their own pid, environment, working directory, argv, sys.path[0], output in their log,
exit code, atexit handlers, and the signal that ends them."""

from __future__ import annotations

import signal
import sys
import time

import pytest

from tests.distributed import forked
from tests.distributed.conftest import process_env

pytestmark = pytest.mark.distributed

SCRIPT = """
import atexit, os, sys, time
atexit.register(lambda: print("atexit ran"))
print("argv", sys.argv[1:], "cwd", os.getcwd(), "path0", sys.path[0], "pid", os.getpid())
print("env", os.environ.get("PROBE"), "unbuffered", end=" ")
sys.stdout.write("yes\\n")
if sys.argv[1] == "wait":
    print("waiting")
    time.sleep(120)
sys.exit(int(sys.argv[1]))
"""


def test_a_forked_rank_runs_the_script_as_the_interpreter_would(tmp_path):
    if forked.runnable([sys.executable, "-u", "x.py"], process_env()) is None:
        pytest.skip("the forkserver is off (ZEROTRAIN_TEST_FORK=0 or not Linux)")
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    work = tmp_path / "work"
    work.mkdir()
    log = tmp_path / "rank.log"
    proc = forked.popen([sys.executable, "-u", str(script), "3"], {**process_env(), "PROBE": "seen"}, log, work)
    assert isinstance(proc, forked.ForkedRank)
    assert proc.wait(timeout=60) == 3
    text = log.read_text()
    assert f"argv ['3'] cwd {work} path0 {tmp_path} pid {proc.pid}" in text, text
    assert "env seen unbuffered yes" in text and text.rstrip().endswith("atexit ran"), text

    log = tmp_path / "wait.log"
    proc = forked.popen([sys.executable, "-u", str(script), "wait"], process_env(), log, work)
    deadline = time.monotonic() + 60
    while "waiting" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == -signal.SIGTERM  # as Popen reports a signalled process


def test_other_commands_start_as_subprocesses(tmp_path):
    proc = forked.popen([sys.executable, "-c", "print('plain')"], process_env(), tmp_path / "c.log", tmp_path)
    assert not isinstance(proc, forked.ForkedRank)
    assert proc.wait(timeout=60) == 0 and "plain" in (tmp_path / "c.log").read_text()
