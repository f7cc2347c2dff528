"""One recipe per launcher (DeepSpeed on one node, DeepSpeed over a hostfile, torchrun, Slurm), and
make_recipe, which checks a request and picks the launcher's."""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from zerotrain.errors import ZerotrainError
from zerotrain.launch.base import Recipe, Request
from zerotrain.launch.commands import (
    ALLOC_CONF,
    config_gpus_per_node,
    deepspeed_command,
    shell_script,
    torchrun_command,
    train_script,
)
from zerotrain.launch.hosts import hostfile_text, parse_hostfile, parse_include, validate_hosts
from zerotrain.launch.image import image_path, in_image
from zerotrain.launch.machine import check_local_gpus, executable, local_gpus, refuse_cuda_visible_devices
from zerotrain.launch.slurm import sbatch_script


def make_recipe(args: argparse.Namespace, environ: Mapping[str, str] | None = None, nvml: Any = None,
                cwd: Path | None = None) -> Recipe:
    """Everything `zerotrain launch` prints, writes or runs, from its arguments; checks the request
    against the config and (for commands that start here) this machine's GPUs."""
    from zerotrain.config import load_config

    if args.nodes is not None and args.nodes < 1:
        raise ZerotrainError(f"--nodes {args.nodes}: at least one node")
    if args.gpus is not None and args.gpus < 1:
        raise ZerotrainError(f"--gpus {args.gpus}: at least one GPU per node")
    if args.include is not None and args.launcher not in ("deepspeed", "hostfile"):
        raise ZerotrainError(f"--include is the DeepSpeed launcher's; with --launcher {args.launcher} use --gpus N")
    if args.run and args.launcher == "slurm":
        raise ZerotrainError("--run starts deepspeed or torchrun here; submit a Slurm script with sbatch (use --write)")
    image = getattr(args, "image", None)
    config = image_path(args.config, cwd, "--config") if image else args.config
    request = Request(args, load_config(args.config, args.overrides),
                      validate_hosts(args.hosts.split(",")) if args.hosts else None,
                      os.environ if environ is None else environ, nvml, train_script(cwd))
    if image:  # the ranks read the config at its path in the container: relative to its working folder
        request.args = argparse.Namespace(**{**vars(args), "config": config})
    if args.launcher == "slurm":
        return slurm_recipe(request, (image, str((cwd or Path.cwd()).resolve())) if image else None)
    if args.launcher == "torchrun":
        recipe = torchrun_recipe(request)
    elif args.launcher == "hostfile" or args.hostfile is not None or request.hosts is not None:
        if image:
            raise ZerotrainError("--image: the image runs no ssh server, so the DeepSpeed launcher cannot start the "
                                 "other nodes' ranks in it; use --launcher torchrun (one container per node) or slurm")
        return hostfile_recipe(request)
    else:
        recipe = deepspeed_recipe(request)
    return in_image(recipe, request, image, config, cwd) if image else recipe


def slurm_recipe(request: Request, image: tuple[str, str] | None = None) -> Recipe:
    args, run = request.args, request.run
    nodes = args.nodes or 1
    gpus = args.gpus or config_gpus_per_node(run.hardware.gpus)
    if gpus is None:
        raise ZerotrainError("--launcher slurm: name the GPUs per node with --gpus-per-node N (the config's "
                             "hardware.gpus is auto, and this machine is not the one the job runs on)")
    train_args, plan = request.train_args(nodes, gpus)
    text = sbatch_script(train_args, nodes=nodes, gpus_per_node=gpus, grace_seconds=run.faults.grace_seconds,
                         signal_seconds=args.grace, job_name=args.job_name, time=args.time,
                         partition=args.partition, account=args.account, cpus_per_task=args.cpus_per_task,
                         requeue=args.requeue, output_dir=str(run.output_dir), python=sys.executable,
                         plan_command=plan, image=image)
    return Recipe("slurm", nodes, gpus, None, {"zerotrain.sbatch": text})


def torchrun_recipe(request: Request) -> Recipe:
    args, hosts, notes = request.args, request.hosts, []
    nodes = args.nodes or (len(hosts) if hosts else 1)
    if nodes == 1:
        gpus = args.gpus or local_gpus(request.environ, request.nvml)
        if not gpus:
            raise ZerotrainError("--launcher torchrun: no GPU is visible here; name the processes per node with "
                                 "--gpus N (with DS_ACCELERATOR=cpu for CPU ranks)")
        note = check_local_gpus(gpus, request.environ, request.nvml, what=f"torchrun --nproc_per_node {gpus}",
                                apply_mask=True, will_run=args.run)
        notes += [note] if note else []
    elif args.gpus is None:
        raise ZerotrainError(f"torchrun on {nodes} nodes: name the processes per node with --gpus N")
    else:
        gpus = args.gpus
        notes.append(f"run the same command on each of the {nodes} nodes; each must show {gpus} GPUs")
    endpoint_host = args.master_addr or (hosts[0] if hosts else None)
    endpoint = f"{endpoint_host}:{args.master_port}" if endpoint_host else None
    train_args, plan = request.train_args(nodes, gpus)
    command = torchrun_command(train_args, nproc_per_node=gpus, nodes=nodes, rdzv_endpoint=endpoint,
                               executable=executable("torchrun"))
    where = "this node" if nodes == 1 else f"each of {nodes} nodes (the same command on every node)"
    description = [f"zerotrain with torchrun: {gpus} process(es) on {where};",
                   f"the planner plans for {nodes} x {gpus} ranks. The plan it trains with:", plan,
                   "Run from the folder the config's relative paths start from."]
    return Recipe("torchrun", nodes, gpus, command, {"launch.sh": shell_script(command, description, gpus)}, notes)


def deepspeed_recipe(request: Request) -> Recipe:
    """The DeepSpeed launcher on this node: GPUs by --include, --gpus N (--num_gpus) or all of them."""
    args, environ, notes = request.args, request.environ, []
    if args.nodes not in (None, 1):
        raise ZerotrainError(f"--nodes {args.nodes} with the DeepSpeed launcher needs the hosts: --launcher hostfile "
                             "--hosts H1,H2 (or --hostfile FILE), or use --launcher slurm")
    include, highest, mask = args.include, None, environ.get("CUDA_VISIBLE_DEVICES")
    if include is not None:
        refuse_cuda_visible_devices(environ, f"is given --include {include}")
        chosen = parse_include(include)
        if list(chosen) != ["localhost"] or chosen["localhost"] is None:
            raise ZerotrainError(f"--include {include}: on one node name GPUs of localhost, e.g. localhost:0,1 "
                                 "(other hosts need --launcher hostfile)")
        gpus, highest = len(chosen["localhost"]), max(chosen["localhost"])
    elif args.gpus is not None:
        refuse_cuda_visible_devices(environ, f"is given --num_gpus {args.gpus}")
        gpus = args.gpus
    elif mask is not None:
        if not re.fullmatch(r"\d+(,\d+)*", mask):
            refuse_cuda_visible_devices(environ, "cannot take GPU UUIDs or an empty list from it")
        include = f"localhost:{mask}"
        indices = [int(i) for i in mask.split(",")]
        gpus, highest = len(indices), max(indices)
        notes.append(f"CUDA_VISIBLE_DEVICES={mask} became --include {include} (the launcher replaces the variable "
                     "for every rank)")
    else:
        gpus = local_gpus(environ, request.nvml, apply_mask=False)
        if not gpus:
            raise ZerotrainError("the DeepSpeed launcher: no GPU is visible here; name the GPUs with --gpus N or "
                                 "--include localhost:0,1 (with DS_ACCELERATOR=cpu for CPU ranks)")
    what = f"deepspeed --include {include}" if include else f"deepspeed --num_gpus {gpus}"
    note = check_local_gpus(gpus, environ, request.nvml, what=what, apply_mask=False, will_run=args.run,
                            highest_index=highest)
    notes += [note] if note else []
    train_args, plan = request.train_args(1, gpus)
    command = deepspeed_command(train_args, gpus=None if include else gpus, include=include,
                                master_port=args.master_port, executable=executable("deepspeed"))
    description = [f"zerotrain with the DeepSpeed launcher: {gpus} GPU(s) on this node; the planner plans for 1 x {gpus}.",
                   "GPUs are chosen with --include/--num_gpus, never CUDA_VISIBLE_DEVICES (the launcher rewrites it).",
                   "The plan it trains with:", plan, "Run from the folder the config's relative paths start from."]
    return Recipe("deepspeed", 1, gpus, command, {"launch.sh": shell_script(command, description, gpus)}, notes)


def hostfile_recipe(request: Request) -> Recipe:
    """The DeepSpeed launcher over a hostfile: given (--hostfile, validated) or written (--hosts)."""
    args, run, hosts = request.args, request.run, request.hosts
    if args.hostfile is not None and hosts is not None:
        raise ZerotrainError("--hostfile and --hosts both name the nodes; give one")
    refuse_cuda_visible_devices(request.environ, "is given a hostfile")
    files: dict[str, str] = {}
    if args.hostfile is not None:
        try:
            pool = parse_hostfile(args.hostfile.read_text(), str(args.hostfile))
        except OSError as err:
            raise ZerotrainError(f"--hostfile {args.hostfile}: cannot be read ({err.strerror})") from err
        hostfile_path = str(args.hostfile)
    elif hosts is not None:
        slots = args.gpus or config_gpus_per_node(run.hardware.gpus)
        if slots is None:
            raise ZerotrainError("--hosts: name the GPUs per node with --gpus N (they become the hostfile's slots)")
        files["hostfile"] = hostfile_text(hosts, slots)
        pool = dict.fromkeys(hosts, slots)
        # Written next to the script (--write), into the run folder (--run), or by the printed script.
        target = args.write if args.write is not None else run.output_dir if args.run else None
        hostfile_path = str((target / "hostfile").resolve()) if target is not None else "hostfile"
    else:
        raise ZerotrainError("--launcher hostfile: name the nodes with --hosts H1,H2 --gpus N, or --hostfile FILE")
    slots = next(iter(pool.values()))
    include, num_nodes = args.include, None
    if include is not None:
        chosen = parse_include(include)
        unknown = [h for h in chosen if h not in pool]
        if unknown:
            raise ZerotrainError(f"--include {include}: host {unknown[0]} is not in the hostfile ({', '.join(pool)})")
        counts = {len(s) if s is not None else slots for s in chosen.values()}
        if len(counts) > 1:
            raise ZerotrainError(f"--include {include}: the same number of GPUs on every host, please (zerotrain "
                                 "plans for identical nodes)")
        nodes, gpus, first = len(chosen), counts.pop(), next(iter(chosen))
    else:
        nodes = args.nodes or len(pool)
        if nodes > len(pool):
            raise ZerotrainError(f"--nodes {nodes}: the hostfile lists only {len(pool)} host(s)")
        gpus = args.gpus or slots
        if gpus > slots:
            raise ZerotrainError(f"--gpus {gpus}: the hostfile gives each host {slots} slot(s)")
        num_nodes, first = (nodes if nodes < len(pool) else None), next(iter(pool))
    train_args, plan = request.train_args(nodes, gpus)
    # One host: the launcher starts the ranks locally and needs no ssh; its ssh check would only fail.
    command = deepspeed_command(train_args, gpus=gpus if include is None and gpus < slots else None, include=include,
                                hostfile=hostfile_path, nodes=num_nodes, master_addr=args.master_addr or first,
                                master_port=args.master_port, ssh_check=nodes > 1, executable=executable("deepspeed"))
    description = [f"zerotrain with the DeepSpeed launcher on {nodes} node(s) x {gpus} GPU(s) from the hostfile;",
                   f"the planner plans for {nodes} x {gpus}. The plan it trains with:", plan,
                   "The launcher starts the other nodes' ranks over passwordless ssh (pdsh), in this same folder,",
                   "passing on only NCCL_*, PYTHON*, UCX_* variables and the lines of ./.deepspeed_env (the",
                   "allocator setting is added there)."]
    prelude = []
    if nodes > 1:
        prelude.append(f"grep -qs '^PYTORCH_CUDA_ALLOC_CONF=' .deepspeed_env || echo "
                       f"'PYTORCH_CUDA_ALLOC_CONF={ALLOC_CONF}' >> .deepspeed_env")
    if hostfile_path == "hostfile" and files:  # printed: the script writes the hostfile itself
        prelude = ["cat > hostfile <<'EOF'", files["hostfile"].rstrip("\n"), "EOF", *prelude]
    script = shell_script(command, description, gpus, prelude)
    written = Path(hostfile_path) if files and hostfile_path != "hostfile" else None
    return Recipe("hostfile", nodes, gpus, command, {"launch.sh": script, **files}, hostfile=written)
