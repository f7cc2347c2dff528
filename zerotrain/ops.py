"""`zerotrain build-ops`: DeepSpeed's ops that training loads, compiled for this machine ahead of a run, and
the build lock a killed build leaves behind. DeepSpeed's public op builders do the work (the accelerator's
create_op_builder, a builder's is_compatible and load); which ops training loads and whether one came
installed with DeepSpeed are deepspeed_compat's to say."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from zerotrain.deepspeed_compat import (
    BUILD_TIME,
    ON_REQUEST_OPS,
    OP_BUILDERS,
    TRAINING_OPS,
    jit_builds,
    prebuilt,
)
from zerotrain.errors import ZerotrainError, one_line


@dataclass(frozen=True)
class OpBuild:
    name: str
    status: str
    """built, prebuilt (installed with DeepSpeed), skipped (cannot be built here) or failed."""
    detail: str

    @property
    def line(self) -> str:
        return f"{self.name}: {self.status} ({self.detail})"


def build_ops(builders: tuple[str, ...] = TRAINING_OPS, say: Callable[[str], None] = lambda line: None) -> list[OpBuild]:
    """Compile the ops `builders` names for this machine's DeepSpeed accelerator now, into torch's
    extension cache (TORCH_EXTENSIONS_DIR), as their first use would (builder.load(), DeepSpeed's
    JIT path): a run then loads them instead of stalling its first step on a compiler, a stall that on
    many nodes can outlast a collective's timeout. Ops DeepSpeed was installed with are left alone;
    ops this machine cannot build (no libaio, no nvcc) are skipped with DeepSpeed's reason. `say` gets
    one line as each compile starts (it takes minutes) and one as each op is done."""
    import io
    import time

    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    out: list[OpBuild] = []
    for class_name in builders:
        builder = accelerator.create_op_builder(class_name)
        if builder is None or builder.name == "deepspeed_not_implemented":
            continue
        if prebuilt(builder.name):
            out.append(OpBuild(builder.name, "prebuilt", "installed with DeepSpeed"))
            say(out[-1].line)
            continue
        probe = io.StringIO()
        with contextlib.redirect_stdout(probe):  # DeepSpeed's compatibility probes print their reasons
            compatible = builder.is_compatible(verbose=True)
        if not compatible:
            reason = " ".join(probe.getvalue().split())[:200] or "its compatibility check failed"
            out.append(OpBuild(builder.name, "skipped", reason))
            say(out[-1].line)
            continue
        clear_stale_build_lock(builder.name)
        pending = jit_builds([builder.name]) if builder.name in OP_BUILDERS else None
        if pending != []:  # [] : load() finds it built for this machine and compiles nothing
            say(f"building {builder.name}: once per machine, {BUILD_TIME.get(builder.name, 'a minute or more')} ...")
        start = time.perf_counter()
        try:
            with contextlib.redirect_stdout(sys.stderr):
                builder.load(verbose=False)
        except Exception as err:  # noqa: BLE001 - a compiler error: DeepSpeed raises whatever the build raised
            out.append(OpBuild(builder.name, "failed", one_line(err, 300)))
        else:
            out.append(OpBuild(builder.name, "built", f"{time.perf_counter() - start:.0f} s"))
        say(out[-1].line)
    return out


def requested(names: list[str], every: bool) -> tuple[tuple[str, ...], list[str]]:
    """The op builders `zerotrain build-ops` builds (the ops named; with `every`, all; else all but those only one
    kind of layout loads), and a line for each op left out."""
    unknown = [name for name in names if name not in OP_BUILDERS]
    if unknown:
        raise ZerotrainError(f"build-ops: no op {', '.join(unknown)}; the ops training loads are "
                             f"{', '.join(OP_BUILDERS)}")
    chosen = names or [name for name in OP_BUILDERS if every or name not in ON_REQUEST_OPS]
    left = [f"{name}: not built (only {ON_REQUEST_OPS[name]} loads it: the first such run builds it, "
            f"{BUILD_TIME[name]}, or `zerotrain build-ops {name}` now)" for name in ON_REQUEST_OPS if not names and name not in chosen]
    return tuple(OP_BUILDERS[name] for name in chosen), left


# An op's build takes minutes (CPU Adam: about 5 on 2 cores); a lock older than this was left by a killed build.
STALE_BUILD_LOCK_S = 30 * 60


def clear_stale_build_lock(name: str, poll_s: float = 5.0) -> Path | None:
    """Wait for op `name`'s build lock (torch's FileBaton, `<extensions dir>/<name>/lock`) to go, saying whose it
    is on stderr, and remove it once it is older than STALE_BUILD_LOCK_S: a build killed while compiling (Ctrl-C,
    a preempted node) leaves it, and torch's own wait for it never ends, silently. A build that is running
    removes its lock within minutes. Returns the lock's path when it was removed as stale."""
    import time

    from torch.utils.cpp_extension import _get_build_directory

    lock = Path(_get_build_directory(name, False)) / "lock"
    said = False
    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return None
        if age >= STALE_BUILD_LOCK_S:
            lock.unlink(missing_ok=True)
            print(f"zerotrain: removed {lock}, left {age / 60:.0f} min ago by a build of {name} that did not finish",
                  file=sys.stderr, flush=True)
            return lock
        if not said:
            print(f"zerotrain: waiting for {lock}, another build of {name} (started {age / 60:.0f} min ago); "
                  f"a lock that old from a build that stopped is removed at {STALE_BUILD_LOCK_S // 60} min, or "
                  "delete it now", file=sys.stderr, flush=True)
            said = True
        time.sleep(poll_s)
