"""The nodes of a multi-node launch: DeepSpeed hostfiles (`HOST slots=N` lines) written from --hosts or
read from --hostfile, and the DeepSpeed launcher's --include syntax."""

from __future__ import annotations

import re

from zerotrain.errors import ZerotrainError


def hostfile_text(hosts: list[str], slots: int) -> str:
    """A DeepSpeed hostfile: one `host slots=N` line per node."""
    hosts = validate_hosts(hosts)
    if slots < 1:
        raise ZerotrainError(f"--gpus {slots}: a node needs at least one GPU slot")
    return "".join(f"{host} slots={slots}\n" for host in hosts)


def validate_hosts(hosts: list[str]) -> list[str]:
    hosts = [h.strip() for h in hosts if h.strip()]
    if not hosts:
        raise ZerotrainError("--hosts: name at least one host, e.g. --hosts node1,node2")
    bad = [h for h in hosts if not re.fullmatch(r"[A-Za-z0-9_.:\-\[\]]+", h)]
    if bad:
        raise ZerotrainError(f"--hosts: '{bad[0]}' is not a host name")
    if len(set(hosts)) != len(hosts):
        raise ZerotrainError(f"--hosts: {','.join(hosts)} names a host twice; one entry per node")
    return hosts


def parse_hostfile(text: str, source: str = "hostfile") -> dict[str, int]:
    """host -> slots from a DeepSpeed hostfile (`host slots=N` lines, # comments). zerotrain plans
    for identical nodes, so every host must have the same number of slots."""
    hosts: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        match = re.fullmatch(r"slots=(\d+)", parts[1]) if len(parts) == 2 else None
        if match is None or int(match.group(1)) < 1:
            raise ZerotrainError(f"{source}:{number}: '{raw.strip()}' is not `HOST slots=N` (N >= 1)")
        if parts[0] in hosts:
            raise ZerotrainError(f"{source}:{number}: host {parts[0]} is listed twice; one line per node")
        hosts[parts[0]] = int(match.group(1))
    if not hosts:
        raise ZerotrainError(f"{source}: no hosts; write one `HOST slots=N` line per node")
    if len(set(hosts.values())) > 1:
        listed = ", ".join(f"{h}={s}" for h, s in hosts.items())
        raise ZerotrainError(f"{source}: hosts have different slot counts ({listed}); zerotrain plans for identical "
                             "nodes: give every host the same slots, or use --gpus N for fewer per node")
    return hosts


def parse_include(spec: str) -> dict[str, list[int] | None]:
    """DeepSpeed's --include syntax, `host:0,1@host2:2,3` (a host without slots means all of it)."""
    result: dict[str, list[int] | None] = {}
    for part in spec.split("@"):
        host, sep, slots = part.strip().partition(":")
        if not host or (sep and not re.fullmatch(r"\d+(,\d+)*", slots)):
            raise ZerotrainError(f"--include {spec}: write HOST:GPU,GPU[@HOST:GPU,...], e.g. localhost:0,1")
        indices = [int(s) for s in slots.split(",")] if sep else None
        if indices is not None and len(set(indices)) != len(indices):
            raise ZerotrainError(f"--include {spec}: GPU listed twice on {host}")
        result[host] = indices
    return result
