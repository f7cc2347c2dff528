"""The root cause of the "terminate called without an active exception" aborts (exit -6) of a
rank that had finished its work, reproduced in a few lines of gloo, with and without zerotrain's
orderly shutdown (zerotrain.distributed.shutdown: a last barrier, then destroy_process_group).

A tensor that carries Python attributes (DeepSpeed tags its parameters and buffers this way) owns
its Python object. When gloo's worker thread drops the last reference to such a tensor after the
interpreter began finalizing (the work finished just as the main thread returned), releasing the
Python object needs the GIL; a thread asking for the GIL during finalization is made to exit, and
that forced unwinding through a noexcept C++ frame calls std::terminate: SIGABRT.

    python benchmarks/gloo_exit_abort.py [--runs 20]

Prints, for each variant, how many of the 2-rank runs had a rank abort; on the 2-core CPU
machine (2026-11-24): without the shutdown 5 of 20 runs aborted, with it 0 of 20."""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RANK_CODE = """
import os, torch, torch.distributed as dist
from zerotrain.distributed import shutdown
dist.init_process_group("gloo")
tensors = []
for i in range(8):
    t = torch.ones(2_000_000)
    t.tag = i  # a Python attribute: the tensor now owns its Python object
    tensors.append(t)
works = [dist.all_reduce(t, async_op=True) for t in tensors]
if os.environ["ORDERLY"] == "1":
    for w in works:
        w.wait()
    shutdown(clean=True)
del tensors, works  # the work may still hold the last references, as a training script's end leaves them
"""


def one_run(orderly: bool) -> list[int]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2",
           "OMP_NUM_THREADS": "1", "ORDERLY": str(int(orderly)), "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, "-c", RANK_CODE], env={**env, "RANK": str(rank)},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for rank in range(2)]
    return [proc.wait(timeout=120) for proc in procs]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    for orderly in (False, True):
        codes = [one_run(orderly) for _ in range(args.runs)]
        aborted = sum(1 for rcs in codes if -6 in rcs)
        print(f"{'with' if orderly else 'without'} the orderly shutdown: {aborted} of {args.runs} runs had a rank "
              f"abort (exit codes seen: {sorted({rc for rcs in codes for rc in rcs})})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
