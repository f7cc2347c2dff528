"""One rank of tests/distributed/test_loading.py: loads a Flux transformer (MODEL_DIR/transformer,
larger than the tiny ones, so that its copies stand out of the interpreter's own memory) for a
ZeRO-3 LoRA run the way train.py does (zerotrain.loading.load with model.load LOAD, LoRA adapters,
deepspeed.initialize through zerotrain's build_engine), and measures this process's anonymous
resident memory (RssAnon: the file's pages in the page cache are not counted, as the kernel does
not count them against the job) every millisecond, from just before the load until the engine
stands. LoRA keeps the optimizer's own memory small, so the peak is the model's.

Then, with TURNS given, the staggered load (loading.in_turns) of the tiny model in TURNS, timing
each rank's load, to check the ranks take turns.

Writes OUT.rank<R>.json: the peak and the kept RssAnon above the start, the bytes of the model's
parameters, how the model was loaded, and the turns' times. Started with RANK/WORLD_SIZE set:

    python load_worker.py MODEL_DIR OUT LOAD [TINY_DIR]
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import torch

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def rss_anon() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


class PeakSampler:
    def __init__(self) -> None:
        self.start = rss_anon()
        self.peak = self.start
        self.running = True
        self.thread = threading.Thread(target=self.sample, daemon=True)
        self.thread.start()

    def sample(self) -> None:
        while self.running:
            self.peak = max(self.peak, rss_anon())
            time.sleep(0.001)

    def stop(self) -> dict[str, int]:
        self.running = False
        self.thread.join()
        now = rss_anon()
        self.peak = max(self.peak, now)
        return {"peak": self.peak - self.start, "kept": now - self.start}


def exact_allocations() -> None:
    """glibc serves every allocation of 64 KiB or more with its own mapping and unmaps it when
    freed (mallopt M_MMAP_THRESHOLD): RssAnon then follows the live tensors. Left to its dynamic
    threshold, glibc keeps freed tensors of a few MiB in its heap, and the resident memory stays
    at its peak whichever way the model was loaded."""
    import ctypes

    ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD


def main() -> int:
    model_dir, out, load = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    exact_allocations()
    tiny = Path(sys.argv[4]) if len(sys.argv) > 4 else None
    torch.set_num_threads(1)
    import deepspeed

    from zerotrain import engine as engine_module
    from zerotrain import loading
    from zerotrain.config import load_config
    from zerotrain.distributed import local_device, shutdown, topology
    from zerotrain.engine import apply_mode, build_engine
    from zerotrain.models.catalog import resolve_model
    from zerotrain.planner.deepspeed_json import deepspeed_config
    from zerotrain.planner.memory import Layout

    deepspeed.init_distributed(dist_backend="gloo")
    topo = topology()
    device = local_device(topo)
    run = load_config(EXAMPLES / "tiny-cpu.yaml", [
        "training.mode=lora", "training.lora.rank=4", f"training.global_batch_size={topo.world_size}",
        "planner.stage3_param_persistence_threshold=0", f"model.load={load}",
        f"data.datasets=[{{path: '{EXAMPLES / 'tiny-data'}'}}]"])
    spec = resolve_model(run.model)
    ds_config = deepspeed_config(Layout(3, micro_batch=1, accumulation=1), run, topo.world_size)
    total = sum(p.numel() for p in loading.skeleton(spec, model_dir).parameters()) * 2

    torch.distributed.barrier()
    sampler = PeakSampler()
    model, done = loading.load(spec, model_dir, run, topo, device, ds_config)
    apply_mode(model, spec, run, False)
    engine = build_engine(model, ds_config, run, device)
    rss = sampler.stop()
    result = {"rss": rss, "model_bytes": total, "loading": done[0],
              "parameters": sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters())}
    del engine, model

    if tiny is not None:
        spans = []
        load_denoiser = engine_module.load_denoiser

        def timed(*args):
            started = time.time()
            try:
                return load_denoiser(*args)
            finally:
                spans.append((started, time.time()))

        engine_module.load_denoiser = timed
        loaded, _ = loading.in_turns(spec, tiny, run, topo, device)
        result["turns"] = spans
        result["turn_parameters"] = sum(p.numel() for p in loaded.parameters())
    Path(f"{out}.rank{topo.rank}.json").write_text(json.dumps(result))
    shutdown(clean=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
