"""zerotrain/distributed.py: ranks from the launcher's or Slurm's variables."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


@pytest.mark.parametrize(("nodelist", "host"), [
    ("gpu07", "gpu07"),
    ("gpu[03-05,09],cpu1", "gpu03"),
    ("node[001-004]", "node001"),
    ("rack1-[12,14-15]-ib", "rack1-12-ib"),
    ("a1,b[2-3]", "a1"),
])
def test_first_host_of_a_slurm_nodelist(nodelist, host):
    from zerotrain.distributed import first_host

    assert first_host(nodelist) == host


def test_slurm_variables_become_torch_rendezvous_variables():
    from zerotrain.distributed import slurm_rendezvous, topology

    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_JOB_NODELIST": "gpu[02-03]",
           "SLURM_JOB_ID": "123456"}
    slurm_rendezvous(env)
    assert {k: env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")} == {
        "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "gpu02", "MASTER_PORT": str(20000 + 3456)}
    assert topology(env) == topology({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1"})

    given = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "MASTER_ADDR": "head", "MASTER_PORT": "29500"}
    slurm_rendezvous(given)
    assert (given["MASTER_ADDR"], given["MASTER_PORT"], given["LOCAL_RANK"]) == ("head", "29500", "0")
    launched = {"RANK": "1", "WORLD_SIZE": "2", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}
    slurm_rendezvous(launched)  # a launcher's variables win over Slurm's
    assert (launched["RANK"], launched["WORLD_SIZE"]) == ("1", "2")


def test_the_device_follows_deepspeeds_accelerator_not_torch_cuda(tmp_path):
    """On a GPU machine the distributed tests run with DS_ACCELERATOR=cpu: rank 1 of 2 must stay on
    the CPU with gloo, not ask for cuda:1 of a 1-GPU node (what torch.cuda.is_available() suggested)."""
    probe = (
        "import torch\n"
        "torch.cuda.is_available = lambda: True\n"  # what a GPU node says
        "from zerotrain.distributed import Topology, accelerator, local_device\n"
        "print(accelerator(), local_device(Topology(rank=1, world_size=2, local_rank=1)))\n"
    )
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, check=True,
                         cwd=tmp_path).stdout.strip().splitlines()[-1]
    assert out == "('cpu', 'gloo') cpu"
