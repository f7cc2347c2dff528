"""zerotrain/distributed.py: ranks from the launcher's or Slurm's variables."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch


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


def test_one_gpu_per_task_is_the_tasks_device_and_deepspeed_is_told(monkeypatch):
    """Issue 48 §5: Slurm's --gpus-per-task=1 (or --gpu-bind, one container per GPU) shows each task one GPU while
    LOCAL_RANK is 3: that GPU, cuda:0, is the task's, and DeepSpeed, which takes its device from LOCAL_RANK, is
    told so; the node-local rank stays 3 for zerotrain's once-per-node work. Seeing some GPUs but fewer than the
    local rank needs is one line with both numbers. CUDA stood in for where it is absent."""
    from zerotrain import distributed
    from zerotrain.distributed import Topology, device_index, use_device
    from zerotrain.errors import ZerotrainError

    assert device_index(3, 8) == 3 and device_index(3, 1) == 0 and device_index(0, 1) == 0
    with pytest.raises(ZerotrainError, match=r"LOCAL_RANK=3, but this process sees 2 GPUs \(CUDA_VISIBLE_DEVICES=4,5\)"):
        device_index(3, 2, {"CUDA_VISIBLE_DEVICES": "4,5"})
    current = []
    monkeypatch.setattr(distributed, "accelerator", lambda: ("cuda", "nccl"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", current.append)
    monkeypatch.setenv("LOCAL_RANK", "3")
    topo = Topology(rank=11, world_size=16, local_rank=3)
    assert use_device(topo) == torch.device("cuda", 0) and current == [torch.device("cuda", 0)]
    assert os.environ["LOCAL_RANK"] == "0" and topo.local_rank == 3
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert use_device(topo) == torch.device("cuda", 3) and os.environ["LOCAL_RANK"] == "3"
