"""Everything zerotrain does inside DeepSpeed: the one package that reads or writes DeepSpeed's
private state, patches it or calls it in a version-specific way. The rest of zerotrain uses
DeepSpeed's public API (deepspeed.initialize, the engine's methods, deepspeed.utils' safe_*
accessors, deepspeed.comm, the accelerator) and this package.

Each reach names the DeepSpeed source it mirrors. They were read in, and tested against, the
versions in zerotrain.versions.TESTED["deepspeed"]; pyproject.toml bounds DeepSpeed below its next
minor version.

The reaches, by what they serve, and their guard:

- Buffer sharing (initialize): ZeRO-3 and ZeRO 1/2 keep buffers that only repeat another when the
  master weights are bf16 (2 bytes per trainable parameter each); zerotrain drops them during and
  after deepspeed.initialize. Guard: buffer_sharing() switches it off, with one warning, on a
  DeepSpeed version not tested, under DS_PIN_MEMORY_BACKEND=native (DeepSpeed unpins its pinned
  buffers by pointer, and a shared one would be freed twice) and where another process takes the
  master (DeepSpeed's decoupled checkpoint writer, ZenFlow, SuperOffload). The planner reads the
  same flag (planner.search.buffers_from), so a plan counts the unshared buffers then. After
  initialize, unshared() checks that each sharing the plan counted on really happened (the same
  storage), and initialize warns with the byte difference where it did not.
- Master fragments for the EMA (master_fragments): ZeRO-1/2's per-parameter _hp_mapping,
  ZeRO-3's partition rank and re-gather, ZeRO-0's fp32 groups. Guard: each class checks the
  attributes it uses and stops with one line naming what is missing.
- The checkpoint writer (guarded_writes): DeepSpeed has no extension point for a checkpoint engine
  of the client's (deepspeed/runtime/checkpoint_engine/utils.py create_checkpoint_engine picks
  torch, fast, decoupled or DataStates from the config), so the engine's checkpoint_engine is
  wrapped for one save. Guard: the attribute is checked before it is swapped.
- CPU Adam's bias-correction replay after a resume (replay_adam_steps): the C++ op's
  adam_update, called positionally (csrc/adam/cpu_adam.cpp). Guard: only on a tested version;
  elsewhere a resumed run may differ from an uninterrupted one in the last bit, and a warning says so.
- ZeRO-3 partitions made before initialize (Partitioner, for zerotrain.loading): zero.Init(module=...)
  with the arguments initialize passes it, then the converted parameters' own
  convert_to_zero_parameters, as runtime/zero/parameter_offload.py does; its _keep_in_fp32 at the
  end. Guard: the attributes are checked, and a missing one stops with one line (model.load: whole
  loads the old way).
- The optimizer's master dtype (master_dtype), DeepSpeed's op report for `zerotrain doctor`
  (op_report: git_version_info, op_builder.all_ops) and whether an op came installed with DeepSpeed
  (prebuilt, for `zerotrain build-ops` in zerotrain/ops.py: git_version_info).
- The timeout of DeepSpeed's own process groups (init_distributed, group_timeouts): deepspeed.comm's
  TorchBackend.new_group(ranks) (comm/torch.py) passes no timeout, so its groups (the data-parallel clone of the
  world where ZeRO reduces and gathers, ZeRO++'s, the sequence-parallel ones) took torch's default (10 minutes
  on NCCL) instead of the world's; the backend's new_group is wrapped to pass it. Guard: only on a tested
  version, with new_group present; elsewhere one warning.
- CPU ranks without a compiler (init_distributed): deepspeed.comm's TorchBackend builds the CPU
  accelerator's shared-memory collective op just in time (comm/torch.py build_shm_op), which fails
  where no C++ compiler is installed (zerotrain's Docker image). The op is marked incompatible in
  deepspeed.ops.__compatible_ops__ (the dict build_shm_op reads; DeepSpeed caches it at first access
  so that edits persist), and the collectives stay gloo's. Guard: only with the CPU accelerator and
  no compiler; the dict is checked to be one.
- One line before an op is compiled just in time (say_jit_builds, from init_distributed, initialize and
  engine.cpu_adam_unavailable): whether load() would compile, as OpBuilder.load decides (its _loaded_ops,
  git_version_info) and torch's extension cache holds it (cpp_extension._get_build_directory, and ninja's
  dry run there), and which ops initialize loads for a config (initialize_ops, after runtime/engine.py
  get_optimizer_configuration). Guard: only on a tested version; elsewhere nothing is said, as before.

- What ZeRO-3 leaves in a process after engine.destroy() (release_process_state): the root module
  in runtime/zero/parameter_offload.py's FWD_MODULE_STACK, `_z3_optimizer` on every parameter
  (stage3.py), and torch.nn.functional.linear replaced by zero3_linear_wrap for the rest of the
  process (partition_parameters.py, memory_efficient_linear). zerotrain runs one engine per process
  (calibrate measures each layout in processes of its own); this is for in-process uses that stay
  (test workers that build several engines). Guard: each global is checked to be what these
  versions make before it is reset.

Public APIs used where they exist: torch.accelerator.empty_host_cache() to give freed pinned memory
back, and the ds_to_universal command line (to_universal) for universal checkpoints.

The package by job: sharing.py (the gate, initialize and the buffers it shares), fragments.py (the
EMA's master fragments), checkpoints.py (the writer, universal checkpoints, the Adam replay), jit.py
(the op report, prebuilt ops, the line before a just-in-time build) and process.py (the process
group, ZeRO-3 partitions before initialize, an abandoned step, what ZeRO-3 leaves behind)."""

from __future__ import annotations

from zerotrain.deepspeed_compat.checkpoints import guarded_writes, replay_adam_steps, to_universal
from zerotrain.deepspeed_compat.fragments import MasterFragments, Span, master_fragments
from zerotrain.deepspeed_compat.jit import (
    BUILD_TIME,
    ON_REQUEST_OPS,
    OP_BUILDERS,
    TRAINING_OPS,
    jit_builds,
    op_report,
    prebuilt,
    say_jit_builds,
)
from zerotrain.deepspeed_compat.process import (
    LOAD_WHOLE,
    Partitioner,
    abandon_step,
    init_distributed,
    release_process_state,
)
from zerotrain.deepspeed_compat.sharing import (
    PIN_BACKEND,
    Sharing,
    buffer_sharing,
    empty_host_cache,
    initialize,
    initialize_ops,
    master_dtype,
    sharing_in_force,
    unshared,
)

__all__ = ["BUILD_TIME", "LOAD_WHOLE", "ON_REQUEST_OPS", "OP_BUILDERS", "PIN_BACKEND", "TRAINING_OPS", "MasterFragments", "Partitioner",
           "Sharing", "Span", "abandon_step", "buffer_sharing", "empty_host_cache", "guarded_writes",
           "init_distributed", "initialize", "initialize_ops", "jit_builds", "master_dtype", "master_fragments",
           "op_report", "prebuilt", "release_process_state", "replay_adam_steps", "say_jit_builds", "sharing_in_force",
           "to_universal", "unshared"]
