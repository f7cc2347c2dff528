"""`zerotrain launch`: the command (or script) that starts zerotrain/train.py on one node or many,
with the topology also given to the planner, so that it plans for nodes x GPUs:

    zerotrain launch --config run.yaml --gpus 8                                 # DeepSpeed launcher, 8 GPUs
    zerotrain launch --config run.yaml --include localhost:0,1                  # GPUs 0 and 1
    zerotrain launch --config run.yaml --launcher hostfile --hosts n1,n2 --gpus 8   # 2 nodes, over ssh (pdsh)
    zerotrain launch --config run.yaml --launcher torchrun --gpus 8 --run
    zerotrain launch --config run.yaml --launcher slurm --nodes 4 --gpus-per-node 8 --time 24:00:00 --write jobs/
    zerotrain launch --config run.yaml --gpus 8 --image zerotrain:0.1.0 --run   # in the Docker image (docker/)

It prints the script (or writes it with --write, or runs it with --run). The rules it enforces are
the ones users trip over (FIELD_NOTES): the DeepSpeed launcher rewrites CUDA_VISIBLE_DEVICES, so
GPUs are chosen with --include; torchrun's --nproc_per_node must not exceed the visible GPUs; a
Slurm job must signal the training tasks (not the batch shell) early enough for zerotrain to write a
checkpoint before the time limit.

The package by job: hosts.py (hostfiles and --include), commands.py (what every rank starts, the
DeepSpeed launcher's and torchrun's commands, the bash script around one), slurm.py (the sbatch
script), machine.py (checks against this machine's GPUs and CUDA_VISIBLE_DEVICES, the launcher
executables), base.py (the Recipe and the Request it is made from), image.py (the Docker image),
recipes.py (one recipe per launcher, and make_recipe, which picks it) and running.py (--run, with
the signals passed to the ranks). This __init__ is the command: add_parser and main.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from zerotrain.launch.base import Recipe, Request
from zerotrain.launch.commands import (
    ALLOC_CONF,
    DEFAULT_PORT,
    config_gpus_per_node,
    deepspeed_command,
    planner_overrides,
    shell_script,
    torchrun_command,
    train_arguments,
    train_script,
)
from zerotrain.launch.hosts import hostfile_text, parse_hostfile, parse_include, validate_hosts
from zerotrain.launch.image import (
    IMAGE_CACHE,
    IMAGE_CACHE_VOLUME,
    IMAGE_WORKDIR,
    STOP_MARGIN_S,
    docker_run,
    image_path,
    in_image,
)
from zerotrain.launch.machine import check_local_gpus, executable, local_gpus, refuse_cuda_visible_devices
from zerotrain.launch.recipes import (
    deepspeed_recipe,
    hostfile_recipe,
    make_recipe,
    slurm_recipe,
    torchrun_recipe,
)
from zerotrain.launch.running import rank_processes, run_forwarding_sigterm
from zerotrain.launch.slurm import SLURM_SIGNAL_MARGIN_S, sbatch_script

__all__ = ["ALLOC_CONF", "DEFAULT_PORT", "IMAGE_CACHE", "IMAGE_CACHE_VOLUME", "IMAGE_WORKDIR", "LAUNCHERS",
           "SLURM_SIGNAL_MARGIN_S", "STOP_MARGIN_S", "Recipe", "Request", "add_parser", "check_local_gpus",
           "config_gpus_per_node", "deepspeed_command", "deepspeed_recipe", "docker_run", "executable",
           "hostfile_recipe", "hostfile_text", "image_path", "in_image", "local_gpus", "main", "make_recipe",
           "parse_hostfile", "parse_include", "planner_overrides", "rank_processes", "refuse_cuda_visible_devices",
           "run_forwarding_sigterm", "sbatch_script", "shell_script", "slurm_recipe", "torchrun_command",
           "torchrun_recipe", "train_arguments", "train_script", "validate_hosts"]

LAUNCHERS = ("deepspeed", "torchrun", "slurm", "hostfile")


def add_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("launch", help="print, write or run the command that starts training: DeepSpeed "
                                           "launcher, hostfile, torchrun or a Slurm batch script",
                            description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=Path, required=True, help="run config (YAML, JSON or TOML)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field (repeatable); passed on to every rank")
    p.add_argument("--launcher", choices=LAUNCHERS, default="deepspeed",
                   help="deepspeed (one node), hostfile (DeepSpeed launcher over ssh on several nodes), torchrun, "
                        "slurm (an sbatch script)")
    p.add_argument("--gpus", "--gpus-per-node", dest="gpus", type=int, metavar="N",
                   help="GPUs (ranks) per node; default: every visible GPU, or the hostfile's slots")
    p.add_argument("--include", metavar="HOST:GPU,...", help="DeepSpeed launcher: which GPUs, e.g. localhost:0,1 "
                                                             "(never CUDA_VISIBLE_DEVICES, which it rewrites)")
    p.add_argument("--nodes", type=int, metavar="N", help="number of nodes (default: 1, or every host given)")
    p.add_argument("--hostfile", type=Path, help="DeepSpeed hostfile (`HOST slots=N` lines) to use")
    p.add_argument("--hosts", help="comma-separated hosts: writes a hostfile (DeepSpeed) or names the rendezvous "
                                   "host (torchrun, the first)")
    p.add_argument("--master-addr", help="rendezvous host (default: the first host)")
    p.add_argument("--master-port", type=int, default=DEFAULT_PORT, help=f"rendezvous port (default {DEFAULT_PORT})")
    p.add_argument("--write", type=Path, metavar="DIR", help="write the script (and hostfile) to DIR instead of "
                                                             "printing")
    p.add_argument("--run", action="store_true", help="run it now (deepspeed, hostfile, torchrun) and return its "
                                                      "exit code")
    s = p.add_argument_group("slurm")
    s.add_argument("--partition")
    s.add_argument("--time", help="time limit, e.g. 24:00:00")
    s.add_argument("--account")
    s.add_argument("--cpus-per-task", type=int, help="CPU cores per GPU task (CPU Adam uses them under offload)")
    s.add_argument("--job-name", default="zerotrain")
    s.add_argument("--grace", type=int, metavar="SECONDS",
                   help=f"send SIGUSR1 this long before the time limit (default faults.grace_seconds + "
                        f"{SLURM_SIGNAL_MARGIN_S})")
    s.add_argument("--requeue", action="store_true",
                   help="requeue the job after a time-limit stop (and on preemption) until the run is done")
    p.add_argument("--image", metavar="IMAGE",
                   help="run in zerotrain's Docker image (docker/): `docker run` with the current folder at "
                        f"{IMAGE_WORKDIR} (deepspeed, torchrun), or srun --container-image (slurm, Pyxis)")


def main(args: argparse.Namespace, environ: Mapping[str, str] | None = None, nvml: Any = None) -> int:
    """`zerotrain launch`: print the script, write it (--write DIR) and/or run it (--run)."""
    environ = dict(os.environ if environ is None else environ)
    recipe = make_recipe(args, environ, nvml)
    for note in recipe.notes:
        print(f"zerotrain: note: {note}", file=sys.stderr)
    if args.write is not None:
        args.write.mkdir(parents=True, exist_ok=True)
        for name, text in recipe.files.items():
            (args.write / name).write_text(text)
            if name.endswith((".sh", ".sbatch")):
                (args.write / name).chmod(0o755)
        script = args.write / next(iter(recipe.files))
        how = f"sbatch {script}" if recipe.launcher == "slurm" else f"bash {script}"
        print(f"wrote {', '.join(str(args.write / n) for n in recipe.files)}; start it with: {how}")
    elif not args.run:
        print(next(iter(recipe.files.values())), end="")
    if not args.run:
        return 0
    if recipe.hostfile is not None and args.write is None:
        recipe.hostfile.parent.mkdir(parents=True, exist_ok=True)
        recipe.hostfile.write_text(recipe.files["hostfile"])
    env = {**environ, "PYTORCH_CUDA_ALLOC_CONF": environ.get("PYTORCH_CUDA_ALLOC_CONF", ALLOC_CONF)}
    if "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // (recipe.gpus_per_node or 1)))
    print("zerotrain: running " + shlex.join(recipe.command), file=sys.stderr, flush=True)
    return run_forwarding_sigterm(recipe.command, env)
