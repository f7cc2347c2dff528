"""The DeepSpeed presets in deepspeed_configs/, each produced by one `zerotrain plan` command.

Regenerate them with `zerotrain presets` (zerotrain.cli.regenerate_presets, which runs each
command); tests/e2e fails when they drift from what the planner writes today."""

from __future__ import annotations

from pathlib import Path

PRESETS: dict[str, list[str]] = {
    "flux-dev-lora-1xA100-80GB.json": [
        "--model", "flux-dev", "--resolution", "1024", "--gpus", "1xA100-80GB", "--mode", "lora",
        "--global-batch", "4"],
    "flux-dev-lora-qint8-1xRTX4090-24GB.json": [
        "--model", "flux-dev", "--resolution", "1024", "--gpus", "1xRTX4090-24GB", "--mode", "lora",
        "--quantize", "qint8", "--global-batch", "4"],
    # The memory floor (issue 14): a full fine-tune with optimizer.name auto and 128 GB of host RAM.
    # One A100-80GB: ZeRO-2, adamw-bf16 offloaded (its bf16 master is DeepSpeed's upload copy).
    "flux-dev-full-adamw-bf16-1xA100-80GB.json": [
        "--model", "flux-dev", "--resolution", "1024", "--gpus", "1xA100-80GB", "--host-memory", "128GB",
        "--mode", "full", "--global-batch", "8", "--set", "optimizer.name=auto"],
    # One 24 GB card: ZeRO-3 with the parameters, adamw-bf16 and the checkpointed blocks' inputs on
    # the host (the master is the pinned bf16 partition, its gradient the gradient partition).
    "flux-dev-full-adamw-bf16-1xRTX4090-24GB.json": [
        "--model", "flux-dev", "--resolution", "1024", "--gpus", "1xRTX4090-24GB", "--host-memory", "128GB",
        "--mode", "full", "--global-batch", "8", "--set", "optimizer.name=auto"],
    "flux-dev-full-8xA100-80GB.json": [
        "--model", "flux-dev", "--resolution", "1024", "--gpus", "8xA100-80GB", "--mode", "full",
        "--global-batch", "8"],
    "sdxl-full-1xRTX4090-24GB.json": [
        "--model", "sdxl-base", "--resolution", "1024", "--gpus", "1xRTX4090-24GB",
        "--mode", "full", "--global-batch", "8"],
    "sd3.5-large-full-8xH100-80GB.json": [
        "--model", "sd3.5-large", "--resolution", "1024", "--gpus", "8xH100-80GB", "--mode", "full",
        "--global-batch", "16"],
    "qwen-image-full-8xH100-80GB.json": [
        "--model", "qwen-image", "--resolution", "1024", "--gpus", "8xH100-80GB", "--mode", "full",
        "--global-batch", "16"],
    # Over a qint8 base nothing fits one RTX 4090 (the 20.4 GB of int8 weights alone leave no room):
    # the plan suggests qint4, which fits.
    "qwen-image-lora-qint4-1xRTX4090-24GB.json": [
        "--model", "qwen-image", "--resolution", "1024", "--gpus", "1xRTX4090-24GB", "--mode", "lora",
        "--quantize", "qint4", "--global-batch", "4"],
    "flux2-dev-lora-1xH100-80GB.json": [
        "--model", "flux2-dev", "--resolution", "1024", "--gpus", "1xH100-80GB", "--mode", "lora",
        "--global-batch", "4"],
    "flux2-dev-full-8xH100-80GB.json": [
        "--model", "flux2-dev", "--resolution", "1024", "--gpus", "8xH100-80GB", "--mode", "full",
        "--global-batch", "16"],
    # The offloaded optimizer's buffers (pinned exactly above 64 MiB, memory.offload_buffers) fit the
    # profile's 128 GiB host: 115 GiB with ZeRO-2's gradient accumulators.
    "z-image-full-1xA100-80GB.json": [
        "--model", "z-image", "--resolution", "1024", "--gpus", "1xA100-80GB",
        "--mode", "full", "--global-batch", "8"],
    # Edit training (issue 23): each reference adds its image's tokens to every step.
    "flux-kontext-dev-lora-1ref-1xRTX4090-24GB.json": [
        "--model", "flux-kontext-dev", "--resolution", "1024", "--references", "1", "--gpus", "1xRTX4090-24GB",
        "--mode", "lora", "--global-batch", "4"],
    "flux2-dev-lora-2ref-1xH100-80GB.json": [
        "--model", "flux2-dev", "--resolution", "1024", "--references", "2", "--gpus", "1xH100-80GB",
        "--mode", "lora", "--global-batch", "4"],
    # Qwen-Image-Edit-2511 (plan only until its processor's torchvision is installed: docs/edit-training.md says why).
    "qwen-image-edit-2511-lora-1ref-1xRTX4090-24GB.json": [
        "--model", "qwen-image-edit-2511", "--resolution", "1024", "--references", "1", "--gpus", "1xRTX4090-24GB",
        "--mode", "lora", "--global-batch", "4"],
    "qwen-image-edit-2511-lora-1ref-1xH100-80GB.json": [
        "--model", "qwen-image-edit-2511", "--resolution", "1024", "--references", "1", "--gpus", "1xH100-80GB",
        "--mode", "lora", "--global-batch", "4"],
    "qwen-image-edit-2511-full-1ref-8xH100-80GB.json": [
        "--model", "qwen-image-edit-2511", "--resolution", "1024", "--references", "1", "--gpus", "8xH100-80GB",
        "--mode", "full", "--global-batch", "16"],
    "chroma-lora-1xRTX4090-24GB.json": [
        "--model", "chroma", "--resolution", "1024", "--gpus", "1xRTX4090-24GB", "--mode", "lora",
        "--global-batch", "4"],
    # Krea 2 (issue 26): a LoRA on Raw, the checkpoint Krea recommends training; the full fine-tune
    # needs two 80 GB cards with the profile's 128 GiB of host RAM each (one does not fit).
    "krea-2-raw-lora-1xRTX4090-24GB.json": [
        "--model", "krea-2-raw", "--resolution", "1024", "--gpus", "1xRTX4090-24GB", "--mode", "lora",
        "--global-batch", "4"],
    "krea-2-raw-full-2xA100-80GB.json": [
        "--model", "krea-2-raw", "--resolution", "1024", "--gpus", "2xA100-80GB", "--mode", "full",
        "--global-batch", "8"],
    # Ideogram 4 (issue 26): the conditional transformer, the one that trains (the unconditional one is
    # loaded for validation renders only); its full fine-tune, as Krea 2's, needs two 80 GB cards.
    "ideogram-4-lora-1xRTX4090-24GB.json": [
        "--model", "ideogram-4", "--resolution", "1024", "--gpus", "1xRTX4090-24GB", "--mode", "lora",
        "--global-batch", "4"],
    "ideogram-4-full-2xA100-80GB.json": [
        "--model", "ideogram-4", "--resolution", "1024", "--gpus", "2xA100-80GB", "--mode", "full",
        "--global-batch", "8"],
    # FLUX.3 [klein] Base (issue 26), the checkpoint for fine-tuning: a text-to-image LoRA and an edit LoRA
    # with one reference on a 24 GB card, and the full fine-tune on the same card and its 64 GiB host with
    # optimizer auto (adamw-bf16: fp32 AdamW would need 93 GiB of host).
    "flux3-klein-base-lora-1xRTX4090-24GB.json": [
        "--model", "flux3-klein-base", "--resolution", "1024", "--gpus", "1xRTX4090-24GB", "--mode", "lora",
        "--global-batch", "4"],
    "flux3-klein-base-lora-1ref-1xRTX4090-24GB.json": [
        "--model", "flux3-klein-base", "--resolution", "1024", "--references", "1", "--gpus", "1xRTX4090-24GB",
        "--mode", "lora", "--global-batch", "4"],
    "flux3-klein-base-full-adamw-bf16-1xRTX4090-24GB.json": [
        "--model", "flux3-klein-base", "--resolution", "1024", "--gpus", "1xRTX4090-24GB", "--mode", "full",
        "--global-batch", "8", "--set", "optimizer.name=auto"],
    # Qwen-Image 2.1 (issue 26): a LoRA, and the full fine-tune on the same card and its 64 GiB host with
    # optimizer auto (adamw-bf16; fp32 AdamW fits neither one RTX 4090 nor one A100-80GB with their hosts).
    "qwen-image-2.1-lora-1xRTX4090-24GB.json": [
        "--model", "qwen-image-2.1", "--resolution", "1024", "--gpus", "1xRTX4090-24GB", "--mode", "lora",
        "--global-batch", "4"],
    "qwen-image-2.1-full-adamw-bf16-1xRTX4090-24GB.json": [
        "--model", "qwen-image-2.1", "--resolution", "1024", "--gpus", "1xRTX4090-24GB", "--mode", "full",
        "--global-batch", "8", "--set", "optimizer.name=auto"],
}

ROOT = Path(__file__).resolve().parents[2] / "deepspeed_configs"
