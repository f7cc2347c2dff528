"""zerotrain's Docker image (docker/): its folders, the `docker run` that starts it, and a deepspeed or
torchrun recipe run inside it (`--image`)."""

from __future__ import annotations

import os
import shlex
from pathlib import Path

from zerotrain.errors import ZerotrainError
from zerotrain.launch.base import Recipe, Request

# The Docker image's (docker/Dockerfile) working folder, where the current folder is mounted, and its
# cache volume (Hugging Face models, planner facts); tests/unit/test_launch.py checks them against it.
IMAGE_WORKDIR = "/workspace"
IMAGE_CACHE = "/cache"
# The named volume `--image` mounts at IMAGE_CACHE, so that downloads outlive the container.
IMAGE_CACHE_VOLUME = "zerotrain-cache"
# `docker stop` waits this long past faults.grace_seconds before its SIGKILL.
STOP_MARGIN_S = 60


def image_path(path: Path, cwd: Path | None, what: str) -> Path:
    """`path` relative to the current folder, which --image mounts at the image's working folder; one
    line when it lies outside (it would not be in the container)."""
    folder = (cwd or Path.cwd()).resolve()
    try:
        return path.resolve().relative_to(folder)
    except ValueError:
        raise ZerotrainError(f"{what} {path}: --image mounts only the current folder ({folder}) at "
                             f"{IMAGE_WORKDIR}; run from a folder that holds it") from None


def docker_run(image: str, cwd: Path | None, grace_seconds: float, multi_node: bool) -> list[str]:
    """`docker run` of the zerotrain image with the GPUs, the current folder at its working folder,
    the cache volume, the caller's uid (files in the run folder are theirs), the host's IPC (NCCL and
    the data loader's shared memory) and a stop timeout that lets zerotrain write its checkpoint."""
    command = ["docker", "run", "--rm", "--gpus", "all", "--ipc=host",
               f"--stop-timeout={int(grace_seconds) + STOP_MARGIN_S}", f"--user={os.getuid()}:{os.getgid()}",
               "-v", f"{(cwd or Path.cwd()).resolve()}:{IMAGE_WORKDIR}", "-v", f"{IMAGE_CACHE_VOLUME}:{IMAGE_CACHE}"]
    if multi_node:  # NCCL and the rendezvous reach the other nodes; InfiniBand needs its devices too
        command += ["--network=host", "--ulimit", "memlock=-1"]
    return [*command, image]


def in_image(recipe: Recipe, request: Request, image: str, config: Path, cwd: Path | None) -> Recipe:
    """The deepspeed or torchrun recipe run in the image: `docker run IMAGE launch ... --run`, whose
    entrypoint runs `zerotrain launch` in the container (which passes a `docker stop`'s SIGTERM straight
    to the ranks); the topology this side resolved is passed on as flags."""
    args = request.args
    inner = ["launch", "--config", str(config), "--launcher", recipe.launcher]
    if recipe.launcher == "deepspeed" and args.include:
        inner += ["--include", args.include]
    else:
        inner += ["--gpus", str(recipe.gpus_per_node)]
    if recipe.launcher == "torchrun" and recipe.nodes > 1:
        inner += ["--nodes", str(recipe.nodes)]
        if args.hosts:
            inner += ["--hosts", args.hosts]
        if args.master_addr:
            inner += ["--master-addr", args.master_addr]
    inner += ["--master-port", str(args.master_port)]
    for override in args.overrides:
        inner += ["--set", override]
    command = [*docker_run(image, cwd, request.run.faults.grace_seconds, recipe.nodes > 1), *inner, "--run"]
    where = "on each node (one container per node)" if recipe.nodes > 1 else "on this node"
    description = [f"zerotrain in the image {image}, {where}: `zerotrain launch` in the container starts",
                   f"{recipe.launcher} for {recipe.nodes} x {recipe.gpus_per_node} ranks. This folder is the container's",
                   f"{IMAGE_WORKDIR}: the config's relative paths must stay inside it."]
    if recipe.nodes > 1:
        description.append("On InfiniBand, add --device /dev/infiniband to docker run.")
    script = "\n".join(["#!/usr/bin/env bash", *(f"# {line}" for line in description), "set -euo pipefail",
                        "exec " + shlex.join(command)]) + "\n"
    return Recipe(recipe.launcher, recipe.nodes, recipe.gpus_per_node, command, {"launch.sh": script}, recipe.notes)
