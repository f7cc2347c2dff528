"""The planner's model-state terms against DeepSpeed's own estimators, under the estimators'
assumptions: everything trainable, no activations, no communication buffers, no allocator
overhead, and (for host RAM) each process loading the model in fp32."""

import pytest
from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

from zerotrain.planner import memory
from zerotrain.planner.memory import PINNED_HOST_FACTOR, Buffers, Layout, Sizes

P = 11_901_408_320  # flux-dev transformer
LARGEST = 56_641_536  # its largest module (DeepSpeed's model_to_params definition)

# No buffers: DeepSpeed's estimators count model states only.
NO_BUFFERS = Buffers(reduce_bucket_size=0, allgather_bucket_size=0, overlap_comm=False,
                     stage3_prefetch_bucket_size=0, sub_group_size=10**15)


def sizes(world: int, gpus_per_node: int | None = None) -> Sizes:
    return Sizes(trainable_params=P, frozen_bytes=0, frozen_shardable=True, largest_layer_params=LARGEST,
                 buffer_bytes=0, world_size=world, gpus_per_node=gpus_per_node or world,
                 load_bytes_per_param=4, total_params=P)


def model_states(layout: Layout, s: Sizes) -> int:
    """Per-GPU bytes at the optimizer step with no activations: the estimators' quantity."""
    return memory.estimate(layout, s, NO_BUFFERS, activation_peak=0, input_bytes=0).phases["optimizer step"] + \
        memory.gathered_params(layout, s, NO_BUFFERS)


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
    # DeepSpeed: P * max(4N, 16) * 1.5. The offload term (16 bytes/param, pinned x1.5) dominates
    # up to 4 GPUs; beyond, DeepSpeed assumes each process also pins an fp32 model copy. The
    # estimator leaves out the pinned bf16 copy of the partition that the real engine holds
    # (param_buffer_of_bit16_for_cpu_offload_groups; tests/distributed measures it).
    bf16_copy = int(memory.LP * (P // world) * world * PINNED_HOST_FACTOR)
    assert abs(memory.host_bytes(layout, s)["offload"] - bf16_copy - ds_cpu) <= 64


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
    # Host: DeepSpeed's 16 bytes/param (x1.5); ours adds the pinned 16-bit gradient partition.
    pinned_grads = int(memory.LP * (P // world) * world * PINNED_HOST_FACTOR)
    assert abs(memory.host_bytes(layout, s)["offload"] - pinned_grads - ds_cpu) <= 64


@pytest.mark.parametrize("world", [1, 8])
def test_zero3_param_offload_equals_deepspeed(world):
    ds_cpu, ds_gpu, _ = estimate_zero3_model_states_mem_needs(P, LARGEST, num_gpus_per_node=world,
                                                              cpu_offload=True, cpu_offload_params=True)
    layout = Layout(stage=3, offload_optimizer="cpu", offload_param="cpu")
    s = sizes(world)
    assert model_states(layout, s) == ds_gpu == 4 * LARGEST
    pinned_grads = int(memory.LP * (P // world) * world * PINNED_HOST_FACTOR)
    assert abs(memory.host_bytes(layout, s)["offload"] - pinned_grads - ds_cpu) <= 64


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
