"""zerotrain launch without starting anything: the commands, hostfiles and sbatch scripts it writes,
the GPU checks against a fake NVML, and the planner overrides for nodes x GPUs.
(tests/distributed/test_launch_recipes.py runs the generated commands.)"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tests.unit.test_hardware import FakeNVML, a100_node
from zerotrain import launch
from zerotrain.config import load_config
from zerotrain.errors import ZerotrainError
from zerotrain.hardware import hardware_facts
from zerotrain.launch import recipes

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "examples" / "tiny-cpu.yaml"  # hardware.gpus: 1 with gpu_memory 8GiB (a bare count)
TRAIN = ["zerotrain/train.py", "--config", "run.yaml"]
NO_GPU = FakeNVML([], init_error="NVML Shared Library Not Found")


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="zerotrain")
    launch.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["launch", "--config", str(CONFIG), *argv])


def recipe(*argv: str, environ=None, nvml=None) -> launch.Recipe:
    return launch.make_recipe(parse(*argv), environ={} if environ is None else environ,
                              nvml=a100_node(3) if nvml is None else nvml, cwd=REPO)


def sets(command: list[str]) -> list[str]:
    return [command[i + 1] for i, arg in enumerate(command) if arg == "--set"]


# ---- pure functions ----


def test_deepspeed_command_chooses_gpus_with_include():
    command = launch.deepspeed_command(TRAIN, include="localhost:0,1", master_port=29600)
    assert command == ["deepspeed", "--include", "localhost:0,1", "--master_port", "29600", *TRAIN]
    assert not any("CUDA_VISIBLE_DEVICES" in arg for arg in command)
    assert launch.deepspeed_command(TRAIN, gpus=4)[:3] == ["deepspeed", "--num_gpus", "4"]
    with pytest.raises(ZerotrainError, match="cannot be combined"):  # the launcher itself refuses this
        launch.deepspeed_command(TRAIN, gpus=2, include="localhost:0,1")


def test_deepspeed_hostfile_command():
    command = launch.deepspeed_command(TRAIN, hostfile="hosts", master_addr="node1", master_port=29500)
    assert command[:7] == ["deepspeed", "--hostfile", "hosts", "--master_addr", "node1", "--master_port", "29500"]
    assert command[7:] == TRAIN
    one_host = launch.deepspeed_command(TRAIN, hostfile="hosts", nodes=1, ssh_check=False)
    assert "--no_ssh_check" in one_host and one_host[one_host.index("--num_nodes") + 1] == "1"


def test_hostfile_text_and_parsing():
    text = launch.hostfile_text(["node1", "node2"], 8)
    assert text == "node1 slots=8\nnode2 slots=8\n"
    assert launch.parse_hostfile("# cluster\n" + text + "\n") == {"node1": 8, "node2": 8}
    for bad, why in [("node1 slots=8\nnode1 slots=8\n", "twice"), ("node1 8\n", "HOST slots=N"),
                     ("node1 slots=0\n", "HOST slots=N"), ("# nothing\n", "no hosts"),
                     ("node1 slots=8\nnode2 slots=4\n", "identical nodes")]:
        with pytest.raises(ZerotrainError, match=why):
            launch.parse_hostfile(bad, "hosts")
    with pytest.raises(ZerotrainError, match="twice"):
        launch.hostfile_text(["a", "a"], 2)


def test_torchrun_command_single_and_multi_node():
    assert launch.torchrun_command(TRAIN, nproc_per_node=2) == ["torchrun", "--standalone", "--nproc_per_node", "2",
                                                                *TRAIN]
    multi = launch.torchrun_command(TRAIN, nproc_per_node=8, nodes=2, rdzv_endpoint="node1:29500")
    assert multi[multi.index("--nnodes") + 1] == "2" and multi[multi.index("--rdzv_endpoint") + 1] == "node1:29500"
    assert "--node_rank" not in multi  # c10d rendezvous: the same command on every node
    with pytest.raises(ZerotrainError, match="rendezvous"):
        launch.torchrun_command(TRAIN, nproc_per_node=8, nodes=2)


def test_sbatch_script_signals_the_tasks_early_enough():
    script = launch.sbatch_script(TRAIN, nodes=4, gpus_per_node=8, grace_seconds=120, time="24:00:00",
                                  partition="gpu", account="proj", cpus_per_task=12)
    directives = [line.removeprefix("#SBATCH ") for line in script.splitlines() if line.startswith("#SBATCH ")]
    for expected in ["--nodes=4", "--ntasks-per-node=8", "--gpus-per-node=8", "--cpus-per-task=12",
                     "--time=24:00:00", "--partition=gpu", "--account=proj", "--signal=USR1@180"]:
        assert expected in directives
    assert not any("B:" in d for d in directives)  # B: would signal only the batch shell, not zerotrain
    body = script.split("\nset -euo pipefail\n", 1)
    assert len(body) == 2 and all(not line.startswith("#SBATCH") for line in body[1].splitlines())
    assert 'MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)"' in script
    assert "export MASTER_ADDR MASTER_PORT" in script
    srun = next(line for line in script.splitlines() if line.startswith("srun ")).removesuffix(" &")
    assert shlex.split(srun)[-len(TRAIN):] == TRAIN and "python" in srun
    assert "CUDA_VISIBLE_DEVICES" not in script
    assert "resume" in script.lower() and "--requeue" not in directives
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)  # valid bash


def test_sbatch_script_grace_and_requeue():
    with pytest.raises(ZerotrainError, match="grace_seconds"):
        launch.sbatch_script(TRAIN, nodes=1, gpus_per_node=1, grace_seconds=120, signal_seconds=100)
    script = launch.sbatch_script(TRAIN, nodes=1, gpus_per_node=2, grace_seconds=30, signal_seconds=300,
                                  requeue=True, output_dir="runs/x")
    assert "#SBATCH --signal=USR1@300" in script and "#SBATCH --requeue" in script
    assert 'if [[ ! -f runs/x/export/export.json ]]; then scontrol requeue "$SLURM_JOB_ID"; fi' in script


def test_planner_overrides_describe_nodes_times_gpus():
    assert launch.planner_overrides("8xA100-80GB", 2, 4) == ["hardware.nodes=2", "hardware.gpus=4xA100-80GB"]
    assert launch.planner_overrides("1", 3, 2) == ["hardware.nodes=3", "hardware.gpus=2"]
    assert launch.planner_overrides("auto", 2, 8) == ["hardware.nodes=2"]  # NVML on each node sees the GPUs
    run = load_config(CONFIG, launch.planner_overrides("1", 2, 4))
    facts = hardware_facts(run.hardware, environ={})
    assert (facts.nodes, facts.gpus_per_node, facts.world_size) == (2, 4, 8)


# ---- make_recipe: the checks ----


def test_recipe_passes_the_topology_to_the_planner():
    r = recipe("--launcher", "hostfile", "--hosts", "node1,node2,node3", "--gpus", "4", "--set", "training.max_steps=5")
    assert (r.nodes, r.gpus_per_node) == (3, 4)
    assert sets(r.command) == ["training.max_steps=5", "hardware.nodes=3", "hardware.gpus=4"]
    assert r.files["hostfile"] == "node1 slots=4\nnode2 slots=4\nnode3 slots=4\n"
    command = r.command
    assert command[command.index("--hostfile") + 1] == "hostfile"
    assert command[command.index("--master_addr") + 1] == "node1"
    assert "zerotrain plan --config" in r.files["launch.sh"]
    assert "cat > hostfile <<'EOF'\nnode1 slots=4\n" in r.files["launch.sh"]  # the printed script writes it
    subprocess.run(["bash", "-n"], input=r.files["launch.sh"], text=True, check=True)


def test_recipe_reads_and_validates_a_hostfile(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("gpu1 slots=8\ngpu2 slots=8\n")
    r = recipe("--hostfile", str(hosts), "--nodes", "1", "--gpus", "4")
    assert (r.nodes, r.gpus_per_node) == (1, 4)
    assert r.command[r.command.index("--num_nodes") + 1] == "1" and "--no_ssh_check" in r.command
    assert sets(r.command)[-2:] == ["hardware.nodes=1", "hardware.gpus=4"]
    with pytest.raises(ZerotrainError, match="only 2 host"):
        recipe("--hostfile", str(hosts), "--nodes", "3")
    with pytest.raises(ZerotrainError, match="8 slot"):
        recipe("--hostfile", str(hosts), "--gpus", "9")
    with pytest.raises(ZerotrainError, match="cannot be read"):
        recipe("--hostfile", str(tmp_path / "missing"))


def test_deepspeed_refuses_cuda_visible_devices_with_include():
    with pytest.raises(ZerotrainError) as err:
        recipe("--include", "localhost:0,1", environ={"CUDA_VISIBLE_DEVICES": "2,3"})
    message = str(err.value)
    assert "CUDA_VISIBLE_DEVICES=2,3" in message and "--include localhost:2,3" in message and "ignores" in message
    with pytest.raises(ZerotrainError, match="CUDA_VISIBLE_DEVICES"):
        recipe("--gpus", "2", environ={"CUDA_VISIBLE_DEVICES": "0,1"})
    with pytest.raises(ZerotrainError, match="CUDA_VISIBLE_DEVICES"):
        recipe("--launcher", "hostfile", "--hosts", "a,b", "--gpus", "2", environ={"CUDA_VISIBLE_DEVICES": "0"})


def test_deepspeed_turns_a_bare_mask_into_include():
    r = recipe(environ={"CUDA_VISIBLE_DEVICES": "1,2"})
    assert r.command[r.command.index("--include") + 1] == "localhost:1,2" and r.gpus_per_node == 2
    assert any("became --include" in note for note in r.notes)
    with pytest.raises(ZerotrainError, match="UUID"):
        recipe(environ={"CUDA_VISIBLE_DEVICES": "GPU-8f3a"})


def test_deepspeed_checks_gpus_against_nvml():
    assert recipe().gpus_per_node == 3  # every GPU of the node
    assert recipe("--include", "localhost:0,2").command[1:3] == ["--include", "localhost:0,2"]
    with pytest.raises(ZerotrainError, match="GPU 3 does not exist"):
        recipe("--include", "localhost:0,3")
    with pytest.raises(ZerotrainError, match="4 processes per node but 3 GPU"):
        recipe("--gpus", "4")
    with pytest.raises(ZerotrainError, match="other hosts need --launcher hostfile"):
        recipe("--include", "node7:0")
    with pytest.raises(ZerotrainError, match="--nodes 2 with the DeepSpeed launcher"):
        recipe("--nodes", "2", "--gpus", "2")


def test_torchrun_refuses_more_processes_than_visible_gpus():
    with pytest.raises(ZerotrainError) as err:
        recipe("--launcher", "torchrun", "--gpus", "3", environ={"CUDA_VISIBLE_DEVICES": "0,1"})
    assert "3 processes per node but 2 GPU(s) visible with CUDA_VISIBLE_DEVICES=0,1" in str(err.value)
    ok = recipe("--launcher", "torchrun", "--gpus", "2", environ={"CUDA_VISIBLE_DEVICES": "0,1"})
    assert ok.command[1:4] == ["--standalone", "--nproc_per_node", "2"]
    assert recipe("--launcher", "torchrun").gpus_per_node == 3  # default: every visible GPU


def test_without_gpus_only_cpu_ranks_run():
    with pytest.raises(ZerotrainError, match="DS_ACCELERATOR=cpu"):
        recipe("--launcher", "torchrun", "--gpus", "2", "--run", nvml=NO_GPU)
    cpu = recipe("--launcher", "torchrun", "--gpus", "2", "--run", nvml=NO_GPU, environ={"DS_ACCELERATOR": "cpu"})
    assert cpu.gpus_per_node == 2 and not cpu.notes
    printed = recipe("--launcher", "torchrun", "--gpus", "2", nvml=NO_GPU)  # a script for another machine
    assert any("not checked" in note for note in printed.notes)
    with pytest.raises(ZerotrainError, match="--gpus N"):
        recipe("--launcher", "torchrun", nvml=NO_GPU)


def test_multi_node_torchrun_uses_a_rendezvous_host():
    r = recipe("--launcher", "torchrun", "--hosts", "node1,node2", "--gpus", "8", nvml=NO_GPU)
    assert r.command[r.command.index("--rdzv_endpoint") + 1] == "node1:29500"
    assert sets(r.command)[-2:] == ["hardware.nodes=2", "hardware.gpus=8"]
    with pytest.raises(ZerotrainError, match="--gpus N"):
        recipe("--launcher", "torchrun", "--nodes", "2", "--master-addr", "node1")


def test_slurm_recipe_takes_the_grace_period_from_the_config():
    r = recipe("--launcher", "slurm", "--nodes", "2", "--gpus-per-node", "4", "--set", "faults.grace_seconds=300")
    script = r.files["zerotrain.sbatch"]
    assert "#SBATCH --signal=USR1@360" in script and "#SBATCH --ntasks-per-node=4" in script
    srun = shlex.split(next(line for line in script.splitlines() if line.startswith("srun ")))
    assert srun[srun.index("--config") + 1] == str(CONFIG)
    assert sets(srun)[-2:] == ["hardware.nodes=2", "hardware.gpus=4"]
    assert r.command is None
    with pytest.raises(ZerotrainError, match="sbatch"):
        recipe("--launcher", "slurm", "--gpus", "2", "--run")


def test_main_writes_the_files(tmp_path, capsys):
    args = parse("--launcher", "hostfile", "--hosts", "localhost", "--gpus", "2", "--write", str(tmp_path / "job"))
    assert launch.main(args, environ={"DS_ACCELERATOR": "cpu"}, nvml=NO_GPU) == 0
    hostfile = tmp_path / "job" / "hostfile"
    assert hostfile.read_text() == "localhost slots=2\n"
    script = (tmp_path / "job" / "launch.sh").read_text()
    assert f"--hostfile {hostfile.resolve()}" in script and "cat >" not in script
    assert (tmp_path / "job" / "launch.sh").stat().st_mode & 0o111
    assert "bash " in capsys.readouterr().out


def test_train_script_is_this_installation_s(tmp_path):
    assert launch.train_script(REPO) == "zerotrain/train.py"  # in a checkout, as the README writes it
    assert launch.train_script(tmp_path) == str(REPO / "zerotrain" / "train.py")  # elsewhere: absolute


FAKE_LAUNCHER = """#!/usr/bin/env bash
# A launcher: one rank (LOCAL_RANK set) with a worker of its own (it inherits LOCAL_RANK, like a data loader
# worker); it waits for the rank. Whoever gets SIGTERM says so in $MARK.
trap 'echo launcher >> "$MARK"' TERM
LOCAL_RANK=0 bash -c 'trap "echo rank \\$OMP_NUM_THREADS \\$PYTORCH_CUDA_ALLOC_CONF >> \\"\\$MARK\\"; kill %1; exit 0" TERM
  sleep 30 & touch "$STARTED"; wait' &
wait $!
"""


def test_run_sends_sigterm_to_the_ranks_not_the_launcher(tmp_path, monkeypatch):
    """As a container's main process, `zerotrain launch --run` gets `docker stop`'s SIGTERM. It goes
    to the ranks (which checkpoint and exit 0), not to the launcher, which would SIGKILL them 30 s later."""
    fake = tmp_path / "torchrun"
    fake.write_text(FAKE_LAUNCHER)
    fake.chmod(0o755)
    monkeypatch.setattr(recipes, "executable", lambda name: str(fake))  # where torchrun_recipe reads it
    environ = {"DS_ACCELERATOR": "cpu", "PATH": os.environ["PATH"], "MARK": str(tmp_path / "mark"),
               "STARTED": str(tmp_path / "started")}

    def stop_when_started():
        deadline = time.monotonic() + 20
        while not (tmp_path / "started").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGTERM)

    before = signal.getsignal(signal.SIGTERM)
    threading.Thread(target=stop_when_started, daemon=True).start()
    assert launch.main(parse("--launcher", "torchrun", "--gpus", "2", "--run"), environ=environ, nvml=NO_GPU) == 0
    who, omp, alloc = (tmp_path / "mark").read_text().split()
    assert who == "rank" and int(omp) >= 1 and alloc == "expandable_segments:True"
    assert signal.getsignal(signal.SIGTERM) == before


# ---- in the Docker image (--image) ----


def image_facts() -> dict:
    """What docker/Dockerfile's runtime stage gives: its working folder, volume, user and PATH, and the
    entrypoint's dispatch of zerotrain commands."""
    parser = pytest.importorskip("dockerfile_parse").DockerfileParser(str(REPO / "docker" / "Dockerfile"))
    items = [i for i in parser.structure if i["instruction"] != "COMMENT"]
    runtime = items[max(i for i, item in enumerate(items) if item["instruction"] == "FROM"):]
    value = {i["instruction"]: i["value"] for i in runtime}  # the last of each kind
    dispatch = (REPO / "docker" / "entrypoint.sh").read_text().split("case", 1)[1]
    return {"workdir": value["WORKDIR"], "volume": value["VOLUME"].strip('[]"'), "user": value["USER"],
            "path": parser.envs["PATH"], "entrypoint": value["ENTRYPOINT"], "dispatch": dispatch}


def test_image_recipes_refer_to_what_is_in_the_image():
    facts = image_facts()
    assert (launch.IMAGE_WORKDIR, launch.IMAGE_CACHE) == (facts["workdir"], facts["volume"])
    assert "/opt/venv/bin" in facts["path"].split(":")  # zerotrain, deepspeed and torchrun are on PATH
    assert facts["entrypoint"] == '["zerotrain-entrypoint"]' and "launch|" in facts["dispatch"]

    # The DeepSpeed launcher: docker run, this folder at the working folder, `launch ... --run` inside
    # (the entrypoint runs `zerotrain launch`, which hands a `docker stop`'s SIGTERM to the ranks).
    command = recipe("--gpus", "2", "--image", "zerotrain:0.1.0", "--set", "training.max_steps=5").command
    image = command.index("zerotrain:0.1.0")
    assert command[:2] == ["docker", "run"] and "--gpus" in command[:image] and "--ipc=host" in command[:image]
    assert f"{REPO}:{facts['workdir']}" in command[:image] and f"zerotrain-cache:{facts['volume']}" in command[:image]
    assert f"--user={os.getuid()}:{os.getgid()}" in command[:image]
    assert "--stop-timeout=180" in command[:image]  # faults.grace_seconds 120 + 60
    inner = command[image + 1:]
    assert inner[:3] == ["launch", "--config", "examples/tiny-cpu.yaml"] and inner[-1] == "--run"
    assert inner[inner.index("--gpus") + 1] == "2" and sets(inner) == ["training.max_steps=5"]

    # torchrun on two nodes: one container per node on the host network, the rendezvous passed on.
    command = recipe("--launcher", "torchrun", "--hosts", "n1,n2", "--gpus", "8", "--image", "zt:1").command
    assert "--network=host" in command and command[command.index("--nodes") + 1] == "2"
    assert command[command.index("--hosts") + 1] == "n1,n2"

    # Slurm: Pyxis starts `zerotrain train` itself (no entrypoint), this folder mounted at the workdir.
    script = recipe("--launcher", "slurm", "--nodes", "2", "--gpus-per-node", "8", "--image", "zt:1").files[
        "zerotrain.sbatch"]
    srun = next(line for line in script.splitlines() if line.startswith("srun "))
    assert f"--container-image=zt:1 --container-mounts={REPO}:{facts['workdir']}" in srun, srun
    assert f"--container-workdir={facts['workdir']} zerotrain train --config examples/tiny-cpu.yaml" in srun, srun


def test_image_refuses_what_the_image_cannot_do(tmp_path):
    with pytest.raises(ZerotrainError, match="runs no ssh server"):
        recipe("--launcher", "hostfile", "--hosts", "n1,n2", "--gpus", "8", "--image", "zt:1")
    outside = tmp_path / "run.yaml"
    outside.write_text(CONFIG.read_text())
    args = parse("--gpus", "1", "--image", "zt:1")
    args.config = outside
    with pytest.raises(ZerotrainError, match="--image mounts only the current folder"):
        launch.make_recipe(args, environ={}, nvml=a100_node(3), cwd=REPO)
