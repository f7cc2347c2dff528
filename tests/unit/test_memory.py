"""The planner's model-state terms against DeepSpeed's own estimators, under the estimators'
assumptions: everything trainable, no activations, no communication buffers, no allocator
overhead, and (for host RAM) each process loading the model in fp32."""

import pytest
from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

from zerotrain.config.sections import PlannerConfig
from zerotrain.planner import memory
from zerotrain.planner.memory import Buffers, Layout, Sizes

P = 11_901_408_320  # flux-dev transformer
LARGEST = 56_641_536  # its largest module (DeepSpeed's model_to_params definition)

# No buffers: DeepSpeed's estimators count model states only (and ZeRO-3 keeps no parameter gathered
# for reuse).
NO_BUFFERS = Buffers(reduce_bucket_size=0, overlap_comm=False, stage3_prefetch_bucket_size=0,
                     stage3_max_live_parameters=0, sub_group_size=10**15)
# DeepSpeed's estimators multiply the host terms by additional_buffer_factor=1.5 for pinning; ours
# rounds each pinned buffer as torch does (tested below), so the comparison is before either.
DS_HOST_FACTOR = 1.5
EXACT = Buffers(pinned_exact_above=0)


def unpinned_offload(layout: Layout, s: Sizes) -> int:
    """The planner's offload bytes per node with every buffer at its exact size."""
    return memory.host_bytes(layout, s, EXACT)["offload"]


def sizes(world: int, gpus_per_node: int | None = None) -> Sizes:
    return Sizes(trainable_params=P, frozen_bytes=0, frozen_shardable=True, largest_layer_params=LARGEST,
                 buffer_bytes=0, world_size=world, gpus_per_node=gpus_per_node or world,
                 load_bytes_per_param=4, total_params=P)


def model_states(layout: Layout, s: Sizes) -> int:
    """Per-GPU bytes at the optimizer step with no activations: the estimators' quantity."""
    return memory.estimate(layout, s, NO_BUFFERS, activation_peak=0, input_bytes=0).phases["optimizer step"] + \
        memory.gathered_params(layout, s, NO_BUFFERS) + memory.unreduced_gradient(layout, s)


@pytest.mark.parametrize("world", [1, 2, 4, 8, 64])
def test_zero2_gpu_equals_deepspeed(world):
    _, ds_gpu = estimate_zero2_model_states_mem_needs(P, num_gpus_per_node=world, cpu_offload=False)
    ours = model_states(Layout(stage=2), sizes(world))
    assert abs(ours - ds_gpu) <= 16  # integer division of partitions


@pytest.mark.parametrize("world", [1, 2, 4])
def test_zero2_offload_equals_deepspeed(world):
    ds_cpu, ds_gpu = estimate_zero2_model_states_mem_needs(P, num_gpus_per_node=world, cpu_offload=True)
    layout = Layout(stage=2, offload_optimizer="cpu")
    s = sizes(world)
    assert model_states(layout, s) == ds_gpu
    # DeepSpeed: P * max(4N, 16) * 1.5. The offload term (16 bytes/param) dominates up to 4 GPUs;
    # beyond, DeepSpeed assumes each process also pins an fp32 model copy. The estimator leaves
    # out the pinned bf16 copy of the partition and the bf16 staging gradient of the largest
    # parameter that the real engine holds (tests/distributed measures them).
    bf16_copy = memory.LP * (P // world) * world
    staging = memory.LP * s.largest_trainable_param * world
    assert abs(unpinned_offload(layout, s) - bf16_copy - staging - ds_cpu / DS_HOST_FACTOR) <= 64


@pytest.mark.parametrize("world", [1, 2, 8, 64])
def test_zero3_gpu_equals_deepspeed_plus_16bit_grad_partition(world):
    """DeepSpeed's ZeRO-3 estimate is 4*largest_layer + 18P/N. ZeRO-3 also allocates a 16-bit
    gradient partition (stage3.py: grad_partitions_flat_buffer, P/N bf16 elements) that the
    estimator leaves out; tests/distributed shows the real engine holds it."""
    _, ds_gpu, _ = estimate_zero3_model_states_mem_needs(P, LARGEST, num_gpus_per_node=world, cpu_offload=False,
                                                         cpu_offload_params=False)
    s = sizes(world)
    layout = Layout(stage=3)
    assert abs(model_states(layout, s) - memory.lp_grads(layout, s) - ds_gpu) <= 64


@pytest.mark.parametrize("world", [1, 2, 8])
def test_zero3_optimizer_offload_equals_deepspeed(world):
    ds_cpu, ds_gpu, _ = estimate_zero3_model_states_mem_needs(P, LARGEST, num_gpus_per_node=world,
                                                              cpu_offload=True, cpu_offload_params=False)
    layout = Layout(stage=3, offload_optimizer="cpu")
    s = sizes(world)
    assert abs(model_states(layout, s) - ds_gpu) <= 64
    # Host: DeepSpeed's 16 bytes/param; ours adds the pinned 16-bit gradient partition.
    pinned_grads = memory.LP * (P // world) * world
    assert abs(unpinned_offload(layout, s) - pinned_grads - ds_cpu / DS_HOST_FACTOR) <= 64


@pytest.mark.parametrize("world", [1, 8])
def test_zero3_param_offload_equals_deepspeed(world):
    ds_cpu, ds_gpu, _ = estimate_zero3_model_states_mem_needs(P, LARGEST, num_gpus_per_node=world,
                                                              cpu_offload=True, cpu_offload_params=True)
    layout = Layout(stage=3, offload_optimizer="cpu", offload_param="cpu")
    s = sizes(world)
    assert model_states(layout, s) == ds_gpu == 4 * LARGEST
    pinned_grads = memory.LP * (P // world) * world
    assert abs(unpinned_offload(layout, s) - pinned_grads - ds_cpu / DS_HOST_FACTOR) <= 64


def test_frozen_params_replicated_under_zero12_and_sharded_under_zero3():
    s = Sizes(trainable_params=10**6, frozen_bytes=2 * 10**9, frozen_shardable=True, largest_layer_params=10**5,
              buffer_bytes=0, world_size=8, gpus_per_node=8)
    for stage in (1, 2):
        assert memory.lp_params(Layout(stage=stage), s) == 2 * 10**6 + 2 * 10**9
    assert memory.lp_params(Layout(stage=3), s) == (2 * 10**6 + 2 * 10**9) // 8
    # Optimizer state exists only for the trainable million.
    assert memory.optimizer_states(Layout(stage=2), s) == 8 * 10**6 // 8


def test_quantized_base_stays_whole_under_zero3():
    s = Sizes(trainable_params=10**6, frozen_bytes=10**9, frozen_shardable=False, largest_layer_params=10**5,
              buffer_bytes=0, world_size=8, gpus_per_node=8)
    assert memory.lp_params(Layout(stage=3), s) == 2 * 10**6 // 8 + 10**9


def test_buffers_are_counted_and_overlap_doubles_the_reduce_bucket():
    s = sizes(8)
    one = Buffers(reduce_bucket_size=5 * 10**8, overlap_comm=False)
    two = Buffers(reduce_bucket_size=5 * 10**8, overlap_comm=True)
    assert memory.reduce_buckets(Layout(stage=2), s, one) == 2 * 5 * 10**8
    assert memory.reduce_buckets(Layout(stage=2), s, two) == 2 * 2 * 5 * 10**8
    # The estimate's backward phase includes them; allocator overhead is on top.
    est = memory.estimate(Layout(stage=2), s, Buffers(fragmentation=0.2, cuda_context_bytes=10**9),
                          activation_peak=0, input_bytes=0)
    assert est.reserved == int(est.allocated * 1.2)
    assert est.device_total == est.reserved + 10**9


def test_peak_phase_is_the_maximum_and_activations_count_in_backward():
    s = sizes(8)
    est = memory.estimate(Layout(stage=3), s, Buffers(), activation_peak=40 * 2**30, input_bytes=0)
    assert est.peak_phase == "backward"
    assert est.allocated == max(est.phases.values())
    assert est.terms["activations"] == 40 * 2**30


def test_pinned_buffers_round_as_torchs_host_allocator():
    """torch's caching host allocator rounds each pinned allocation up to a power of two
    (pytorch#95823: 20.4 GiB pinned as 32 GiB); above pinned_max_round_threshold_mb it is exact."""
    mib = 2**20
    assert memory.pinned_bytes(int(20.4 * 1024) * mib, None) == 32 * 1024 * mib
    assert memory.pinned_bytes(int(20.4 * 1024) * mib, 64 * mib) == int(20.4 * 1024) * mib
    assert memory.pinned_bytes(40 * mib, 64 * mib) == 64 * mib  # small buffers still round (and are reused)
    assert memory.pinned_bytes(64 * mib, 64 * mib) == 64 * mib
    assert memory.pinned_bytes(0, None) == 0


def test_offload_host_bytes_pin_what_deepspeed_pins():
    """ZeRO-2 with the optimizer offloaded, one rank of sdxl's 2.57B: the fp32 master, its fp32
    gradient and the bf16 upload copy are pinned (rounded up without the threshold); the Adam
    moments are plain host memory (DeepSpeedCPUAdam's zeros_like), never rounded."""
    n = 2_567_463_684
    s = Sizes(trainable_params=n, frozen_bytes=0, frozen_shardable=True, largest_layer_params=10**7,
              buffer_bytes=0, world_size=1, gpus_per_node=1, largest_trainable_param=10**7, total_params=n)
    layout = Layout(stage=2, offload_optimizer="cpu", micro_batch=8)
    exact = memory.host_bytes(layout, s, Buffers())["offload"]
    assert exact == 4 * n + 4 * n + 2 * n + memory.pinned_bytes(2 * 10**7, 64 * 2**20) + 8 * n
    rounded = memory.host_bytes(layout, s, Buffers(pinned_exact_above=None))["offload"]
    power = memory.pinned_bytes
    assert rounded == 2 * power(4 * n, None) + power(2 * n, None) + power(2 * 10**7, None) + 8 * n
    pinned = {b.name for b in memory.offload_buffers(layout, s, Buffers()) if b.pinned}
    assert pinned == {"fp32 master", "fp32 grads", "bf16 upload copy", "grad staging"}


def test_zero3_offload_pins_its_gradients_not_its_master_weights():
    s = Sizes(trainable_params=3 * 10**9, frozen_bytes=0, frozen_shardable=True, largest_layer_params=10**7,
              buffer_bytes=0, world_size=2, gpus_per_node=2, total_params=3 * 10**9)
    buffers = {b.name: b for b in memory.offload_buffers(Layout(stage=3, offload_optimizer="cpu"), s,
                                                          Buffers(sub_group_size=10**9))}
    assert not buffers["fp32 master"].pinned and buffers["fp32 grads"].pinned
    assert buffers["fp32 grads"].sizes == (4 * 10**9, 4 * 5 * 10**8)  # one per sub-group of the 1.5B partition
    assert buffers["bf16 grad partition"].sizes == (2 * 15 * 10**8,)


@pytest.mark.parametrize(("given", "threshold", "expected"), [
    (None, 64, "expandable_segments:True,pinned_max_round_threshold_mb:64"),
    ("expandable_segments:True", 128, "expandable_segments:True,pinned_max_round_threshold_mb:128"),
    ("pinned_max_round_threshold_mb:16", 64, "pinned_max_round_threshold_mb:16"),  # the user's own wins
    ("expandable_segments:False", None, "expandable_segments:False"),  # null: the allocator is left alone
])
def test_training_sets_the_pinning_the_planner_assumes(monkeypatch, given, threshold, expected):
    import os

    from zerotrain.config import load_config
    from zerotrain.trainer import allocator_settings

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", given or "")  # recorded, so the test leaves it as it was
    if given is None:
        monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    allocator_settings(load_config(None, [f"planner.pinned_exact_above_mib={'null' if threshold is None else threshold}"]))
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == expected


@pytest.mark.parametrize(("stage", "world", "per_node"), [(0, 8, 8), (1, 8, 8), (2, 16, 8), (3, 16, 8)])
def test_the_ema_is_in_the_host_ram_a_plan_counts(stage, world, per_node):
    """Issue 48 §6: each rank keeps the EMA of the trainable elements its optimizer partition owns, in fp32 on the
    host (all of them at ZeRO-0), so a FLUX.1 full fine-tune's node holds 4 bytes per element per share: about 48 GB
    on one 8-GPU node, eight times that at ZeRO-0; rendering validation with the EMA holds the trained masters
    beside it. The plan's host figure is the largest phase."""
    import dataclasses

    layout = Layout(stage, offload_optimizer="cpu" if stage else "none")
    plain = sizes(world, per_node)
    offload = memory.host_bytes(layout, plain)["offload"]
    assert "training" not in memory.host_bytes(layout, plain)
    with_ema = memory.host_bytes(layout, dataclasses.replace(plain, ema=True))
    share = P if stage == 0 else -(-P // world)
    assert with_ema["training"] == offload + per_node * 4 * share
    assert "validation" not in with_ema
    validating = memory.host_bytes(layout, dataclasses.replace(plain, ema=True, ema_validation=True))
    assert validating["validation"] == offload + 2 * per_node * 4 * share
    estimate = memory.estimate(layout, dataclasses.replace(plain, ema=True, ema_validation=True), Buffers(),
                               activation_peak=0, input_bytes=0)
    assert estimate.host_per_node == max(estimate.host_terms.values()) >= validating["validation"]


def test_a_plan_with_the_ema_counts_it_and_refuses_a_host_it_does_not_fit(tmp_path):
    """A FLUX.1 full fine-tune on one 8xA100-80GB node: the EMA's 44 GiB is in the chosen layout's host figure
    (twice that with validation rendering from it), and a 48 GiB host that fits the run without the EMA fits
    no layout with it, where the plan used to fit it."""
    from zerotrain.config import RunConfig
    from zerotrain.models.catalog import resolve_model
    from zerotrain.planner.entry import plan_for_run

    def plan(host: str, **sections):
        run = RunConfig.model_validate({"model": {"name_or_path": "flux-dev"}, "training": {"mode": "full"},
                                        "hardware": {"gpus": "8xA100-80GB", "host_memory": host},
                                        "planner": {"cache_dir": str(tmp_path)}, **sections})
        return plan_for_run(run, resolve_model(run.model)).result

    without, with_ema = plan("512GiB"), plan("512GiB", ema={"enabled": True})
    workers = 8 * 2 * PlannerConfig().loader_worker_bytes  # data.num_workers: 2 per rank
    assert without.chosen.memory.host_terms["training"] == without.chosen.memory.host_terms["offload"] + workers
    assert with_ema.chosen.memory.host_terms["training"] >= 4 * P + workers
    rendering = plan("512GiB", ema={"enabled": True}, validation={"prompts": ["a cat"], "use_ema": True}).chosen
    assert rendering.memory.host_terms["validation"] >= 2 * 4 * P
    assert plan("48GiB").chosen is not None
    refused = plan("48GiB", ema={"enabled": True})
    assert refused.chosen is None
    assert any("host RAM per node" in (c.rejected or "") for c in refused.candidates)


def test_a_plan_counts_the_dataloader_workers_host_ram(tmp_path):
    """Issue 48 §6: each rank's data.num_workers DataLoader workers are processes of their own, alive while the run
    trains and validates: the plan's training phase holds planner.loader_worker_bytes for each of the node's."""
    from zerotrain.config import RunConfig
    from zerotrain.models.catalog import resolve_model
    from zerotrain.planner.entry import plan_for_run

    def terms(workers: int) -> dict[str, int]:
        run = RunConfig.model_validate({"model": {"name_or_path": "flux-dev"}, "training": {"mode": "lora"},
                                        "hardware": {"gpus": "8xA100-80GB", "host_memory": "512GiB"},
                                        "data": {"num_workers": workers}, "planner": {"cache_dir": str(tmp_path)}})
        return plan_for_run(run, resolve_model(run.model)).result.chosen.memory.host_terms

    none, four = terms(0), terms(4)
    assert "training" not in none
    assert four["training"] == four["offload"] + 8 * 4 * PlannerConfig().loader_worker_bytes


def test_a_plan_counts_the_dataset_index_host_ram(tmp_path):
    """Issue 49 §2: each rank process holds planner.dataset_entry_bytes per entry of the dataset index at
    data.cache_dir (its mapped rows, the epoch's samples, the sampler's arrays; the workers map the same file and
    add none): the training phase counts it for each of the node's ranks."""
    import numpy as np

    from zerotrain.config import RunConfig
    from zerotrain.data import index as data_index
    from zerotrain.models.catalog import resolve_model
    from zerotrain.planner.entry import plan_for_run

    def terms() -> dict[str, int]:
        run = RunConfig.model_validate({"model": {"name_or_path": "flux-dev"}, "training": {"mode": "lora"},
                                        "hardware": {"gpus": "8xA100-80GB", "host_memory": "512GiB"},
                                        "data": {"num_workers": 0, "cache_dir": str(tmp_path / "cache")},
                                        "planner": {"cache_dir": str(tmp_path)}})
        return plan_for_run(run, resolve_model(run.model)).result.chosen.memory.host_terms

    assert "training" not in terms()  # no index yet: no entries counted
    entries = 250_000
    index = data_index.Index(np.zeros(entries, data_index.ROW), np.zeros(0, data_index.TEXT), {"datasets": []})
    plans = tmp_path / "plans.bin"
    plans.write_bytes(b"")
    data_index.write(tmp_path / "cache", index, plans)
    counted = terms()
    assert counted["training"] == counted["offload"] + 8 * entries * PlannerConfig().dataset_entry_bytes
