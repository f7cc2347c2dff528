"""CPU ranks where no C++ compiler is installed (zerotrain's Docker image): deepspeed.init_distributed
would build the CPU accelerator's shared-memory collective op just in time and fail;
zerotrain.deepspeed_compat.init_distributed marks it incompatible first, and the collectives run on
gloo. One process, with CXX naming a compiler that does not exist."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.distributed.conftest import free_port, process_env

pytestmark = pytest.mark.distributed

SCRIPT = """
import torch, deepspeed
from zerotrain.deepspeed_compat import init_distributed
init_distributed("gloo")
import deepspeed.comm as dist
t = torch.ones(3)
dist.all_reduce(t)
print("shm", deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"], "sum", t.tolist())
"""


def test_cpu_ranks_without_a_compiler_keep_gloo_s_collectives(tmp_path):
    env = {**process_env(), "CXX": str(tmp_path / "no-such-compiler"), "RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "TORCH_EXTENSIONS_DIR": str(tmp_path / "extensions")}
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300,
                         check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "shm False sum [1.0, 1.0, 1.0]" in out.stdout, out.stdout
    assert not (tmp_path / "extensions").exists(), "an op was built"
