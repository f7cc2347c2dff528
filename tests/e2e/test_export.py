"""`zerotrain.export` on real DeepSpeed checkpoints of tiny models.

One worker process (this file run as a script, DS_ACCELERATOR=cpu, gloo, world size 1) trains
tiny-flux for one optimizer step under DeepSpeed stage 0, ZeRO-2 and ZeRO-3, full and LoRA, with
zerotrain's own DeepSpeed config (deepspeed_config), and tiny-sdxl / tiny-sd3 LoRA at stage 0. Each
writes a run folder as the training loop does (config.yaml, checkpoints/<tag> from
engine.save_checkpoint, checkpoints/latest) and, for the comparison, the weights the engine holds
after the step (gathered with deepspeed.zero.GatheredParameters under ZeRO-3) in engine.safetensors.

The tests export each run and check that the weights equal the engine's, are not the untrained
ones, load with diffusers (from_pretrained / load_lora_weights) and change what the tiny pipeline
generates; that the ComfyUI LoRA is the same update under ComfyUI's names; and the errors."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

TAG = "step-00000001"
LORA_FILE = "pytorch_lora_weights.safetensors"
RANK, ALPHA = 4, 8.0  # alpha / rank = 2: the exported LoRA must carry its scale
LR = 0.05  # one Adam step moves every trained weight by about this much
WORKER_TIMEOUT_S = 600  # first use JIT-compiles DeepSpeed's CPU ops (minutes, once)
FLUX_CASES = [(stage, mode) for stage in (0, 2, 3) for mode in ("full", "lora")]
OTHER_CASES = [("tiny-sdxl", 0, "lora"), ("tiny-sd3", 0, "lora")]
# Issue 25: the other adapters (LoKr and DoRA under ZeRO-3, whose hooks must gather their factors),
# and a LoRA continued from the stage-0 LoRA's export with zero steps.
VARIANT_CASES = [("tiny-flux", 3, "lokr"), ("tiny-flux", 2, "loha"), ("tiny-flux", 3, "dora")]
VARIANTS = {"lokr": {"type": "lokr"}, "loha": {"type": "loha"}, "dora": {"use_dora": True}}
PIPELINES = {"tiny-flux": "FluxPipeline", "tiny-sd3": "StableDiffusion3Pipeline",
             "tiny-sdxl": "StableDiffusionXLPipeline"}
SIDE = 16


def case_name(model: str, stage: int, mode: str) -> str:
    return f"{model}-zero{stage}-{mode}"


# --- the worker --------------------------------------------------------------------------------------


def run_config(model_dir: Path, mode: str, output_dir: Path, init_from: Path | None = None):
    from zerotrain.config import RunConfig

    training = {"mode": "full" if mode == "full" else "lora", "global_batch_size": 1, "micro_batch_size": 1,
                "gradient_checkpointing": False}
    if mode in VARIANTS or mode == "lora":
        training["lora"] = {"rank": RANK, "alpha": ALPHA, **VARIANTS.get(mode, {})}
    if mode == "init":
        training["lora"] = {"init_from": str(init_from)}
    return RunConfig.model_validate({
        "model": {"name_or_path": str(model_dir)},
        "training": training,
        "data": {"resolution": 64, "text_tokens": 8},
        "optimizer": {"lr": LR, "weight_decay": 0.0},
        "planner": {"reduce_bucket_size": 5000, "allgather_bucket_size": 5000,
                    "stage3_prefetch_bucket_size": 5000, "stage3_param_persistence_threshold": 200},
        "output_dir": str(output_dir),
    })


def train_one_step(model_dir: Path, stage: int, mode: str, run_dir: Path, init_from: Path | None = None) -> None:
    """One optimizer step under DeepSpeed (none for mode init, which continues init_from's LoRA), then the
    run folder as the training loop writes it."""
    import deepspeed
    import yaml
    from safetensors.torch import save_file

    from zerotrain.adapters import apply_lora, resolve
    from zerotrain.deepspeed_compat import release_process_state
    from zerotrain.families import example_inputs
    from zerotrain.models.catalog import resolve_model
    from zerotrain.planner.deepspeed_json import deepspeed_config
    from zerotrain.planner.memory import Layout

    spec = resolve_model(run_config(model_dir, mode, run_dir, init_from).model)
    run = resolve(run_config(model_dir, mode, run_dir, init_from), spec)
    model = spec.denoiser_class().from_pretrained(model_dir, subfolder=spec.subfolder, torch_dtype=torch.bfloat16)
    if mode != "full":
        apply_lora(model, spec, run)
    model = model.to(torch.bfloat16)  # peft creates adapters in fp32
    config = deepspeed_config(Layout(stage, micro_batch=1, accumulation=1), run, world_size=1)
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=trainable, config=config)
    torch.manual_seed(stage)
    inputs = example_inputs(spec, 1, 64, 64, run.data.text_tokens, "cpu", torch.bfloat16)
    out = engine(**inputs, return_dict=False)[0]
    engine.backward(torch.nn.functional.mse_loss(out.float(), torch.randn_like(out, dtype=torch.float32)))
    if mode != "init":
        engine.step()
        assert engine.global_steps == 1
    engine.save_checkpoint(str(run_dir / "checkpoints"), tag=TAG, save_latest=False)
    (run_dir / "checkpoints" / TAG / "zerotrain_state.json").write_text(json.dumps({"step": 1}))
    (run_dir / "checkpoints" / "latest").write_text(TAG)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(run.model_dump(mode="json")))
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = [p for p in model.parameters() if p.requires_grad]
    with deepspeed.zero.GatheredParameters(params):
        held = {name: p.detach().clone() for name, p in zip(names, params)}
    assert all(t.numel() > 0 for t in held.values())
    save_file(held, str(run_dir / "engine.safetensors"))
    engine.destroy()
    release_process_state(model)  # the next case's engine starts as in a fresh process (F.linear restored)


def worker(workdir: Path) -> int:
    import deepspeed

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    models = json.loads((workdir / "models.json").read_text())
    from deepspeed.runtime.zero import parameter_offload

    from zerotrain.export import export

    linear = torch.nn.functional.linear
    cases = [("tiny-flux", *case) for case in FLUX_CASES] + OTHER_CASES + VARIANT_CASES
    for model, stage, mode in cases:
        train_one_step(Path(models[model]), stage, mode, workdir / case_name(model, stage, mode))
        # released after each engine (deepspeed_compat.release_process_state): the cases after the
        # ZeRO-3 ones train with torch's F.linear, not DeepSpeed's, and no old module on its stack
        assert torch.nn.functional.linear is linear and not parameter_offload.FWD_MODULE_STACK, (model, stage, mode)
    from safetensors.torch import load_file, save_file

    first = export(workdir / case_name("tiny-flux", 0, "lora"), out=workdir / "first-export", comfyui=True)
    train_one_step(Path(models["tiny-flux"]), 0, "init", workdir / case_name("tiny-flux", 0, "init-lora"),
                   first / "lora" / LORA_FILE)
    # diffusers' converter of kohya Flux names splits a single block's fused linear1 by the published
    # widths, so the tiny model continues the double blocks' part of the ComfyUI file.
    comfy = load_file(first / "comfyui" / f"{case_name('tiny-flux', 0, 'lora')}-{TAG}.safetensors")
    save_file({k: v for k, v in comfy.items() if "double_blocks" in k}, str(workdir / "comfy-double.safetensors"))
    train_one_step(Path(models["tiny-flux"]), 0, "init", workdir / case_name("tiny-flux", 0, "init-comfyui"),
                   workdir / "comfy-double.safetensors")
    return 0


# --- fixtures ----------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    from zerotrain.models.tiny import build_tiny_pipeline

    root = tmp_path_factory.mktemp("models")
    return {name: build_tiny_pipeline(name, root / name) for name in PIPELINES}


@pytest.fixture(scope="module")
def runs(models, tmp_path_factory) -> Path:
    """Run folders of every case, written by one DeepSpeed worker process."""
    workdir = tmp_path_factory.mktemp("runs")
    (workdir / "models.json").write_text(json.dumps({k: str(v) for k, v in models.items()}))
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, __file__, str(workdir)], env=env, capture_output=True, text=True,
                          timeout=WORKER_TIMEOUT_S, check=False)
    if proc.returncode:
        pytest.fail(f"DeepSpeed worker failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    return workdir


@pytest.fixture(scope="module")
def pipelines(models):
    import diffusers

    return {name: getattr(diffusers, cls).from_pretrained(models[name]) for name, cls in PIPELINES.items()}


def generate(pipeline) -> torch.Tensor:
    kwargs = {"max_sequence_length": 16} if type(pipeline).__name__ != "StableDiffusionXLPipeline" else {}
    image = pipeline("a photo of a cat", num_inference_steps=1, height=SIDE, width=SIDE, output_type="pt",
                     generator=torch.Generator().manual_seed(0), **kwargs).images
    assert torch.isfinite(image).all()
    return image


def engine_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(run_dir / "engine.safetensors")


def base_weights(model_dir: Path, subfolder: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted((model_dir / subfolder).glob("*.safetensors"))
    return {k: v for path in files for k, v in load_file(path).items()}


def as_saved(engine_name: str, component: str) -> str:
    """peft's injected name -> the name diffusers' save_lora_weights writes."""
    return f"{component}.{engine_name.replace('.default.', '.')}"


# --- full fine-tune ----------------------------------------------------------------------------------


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_full_export_is_the_trained_model_and_generates(runs, models, pipelines, stage, tmp_path):
    from diffusers import FluxTransformer2DModel
    from safetensors.torch import load_file

    from zerotrain.export import export

    run_dir = runs / case_name("tiny-flux", stage, "full")
    out = export(run_dir)
    assert out == run_dir / "export"
    exported = {k: v for p in sorted((out / "transformer").glob("*.safetensors")) for k, v in load_file(p).items()}
    held, base = engine_weights(run_dir), base_weights(models["tiny-flux"], "transformer")
    assert exported.keys() == held.keys() == base.keys()
    for name, tensor in exported.items():
        assert tensor.dtype == torch.bfloat16 and tensor.numel() > 0 and tensor.shape == base[name].shape
        assert torch.equal(tensor, held[name]), f"{name} differs from the engine's weights"
    assert sum(not torch.equal(exported[n], base[n].to(torch.bfloat16)) for n in base) > len(base) // 2
    manifest = json.loads((out / "export.json").read_text())
    assert manifest["tag"] == TAG and manifest["step"] == 1 and manifest["mode"] == "full"
    assert ("fp32 master" in manifest["source"]) and (("ZeRO-" in manifest["source"]) == (stage > 0))

    transformer = FluxTransformer2DModel.from_pretrained(out / "transformer")
    pipeline = pipelines["tiny-flux"]
    original = pipeline.transformer
    try:
        before = generate(pipeline)
        pipeline.transformer = transformer.to(torch.float32)
        after = generate(pipeline)
    finally:
        pipeline.transformer = original
    assert not torch.allclose(before, after)


def test_export_command_writes_a_folder_diffusers_loads(runs, tmp_path):
    """`zerotrain export RUN --out DIR` as a user runs it (the installed console script), on the
    ZeRO-3 run (consolidated offline by DeepSpeed): it exits 0, names the folder, and the folder
    loads with diffusers' from_pretrained, holding the weights the engine held."""
    from diffusers import FluxTransformer2DModel

    script = Path(sys.executable).with_name("zerotrain")
    assert script.is_file(), f"{script} is missing: install the package (pip install -e .)"
    run_dir, out = runs / case_name("tiny-flux", 3, "full"), tmp_path / "exported"
    result = subprocess.run([str(script), "export", str(run_dir), "--out", str(out)], capture_output=True, text=True,
                            timeout=300, check=False, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert result.stdout.splitlines()[-1] == f"exported to {out}", result.stdout[-2000:]
    loaded = FluxTransformer2DModel.from_pretrained(out / "transformer", torch_dtype=torch.bfloat16).state_dict()
    held = engine_weights(run_dir)
    assert loaded.keys() == held.keys()
    differ = [name for name, tensor in held.items() if not torch.equal(loaded[name], tensor)]
    assert not differ, f"{len(differ)} tensors differ from the engine's, e.g. {differ[:3]}"


def test_zero3_checkpoint_modules_are_empty_but_the_export_is_not(runs):
    """The premise: ZeRO-3's saved module holds size-0 partitions (kohya#1782)."""
    states = torch.load(runs / case_name("tiny-flux", 3, "full") / "checkpoints" / TAG /
                        "zero_pp_rank_0_mp_rank_00_model_states.pt", weights_only=False)
    assert any(t.numel() == 0 for t in states["module"].values())


def test_full_export_with_comfyui_writes_one_file_with_diffusers_keys(runs, tmp_path):
    from safetensors.torch import load_file

    from zerotrain.export import export

    run_dir = runs / case_name("tiny-flux", 2, "full")
    out = export(run_dir, out=tmp_path / "out", comfyui=True)
    single = load_file(out / "comfyui" / f"{run_dir.name}-{TAG}.safetensors")
    assert single.keys() == engine_weights(run_dir).keys()
    assert "x_embedder.weight" in single  # what ComfyUI's convert_diffusers_mmdit detects Flux by


# --- LoRA --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_lora_export_loads_with_its_scale_and_changes_the_image(runs, pipelines, stage):
    from safetensors import safe_open
    from safetensors.torch import load_file

    from zerotrain.export import export

    run_dir = runs / case_name("tiny-flux", stage, "lora")
    out = export(run_dir, TAG, comfyui=True)
    path = out / "lora" / "pytorch_lora_weights.safetensors"
    saved = load_file(path)
    with safe_open(path, "pt") as f:
        metadata = json.loads(f.metadata()["lora_adapter_metadata"])
    held = engine_weights(run_dir)
    assert saved.keys() == {as_saved(name, "transformer") for name in held}
    assert not any(k.startswith("module.") or ".default." in k for k in saved)
    for name, tensor in held.items():
        assert torch.equal(saved[as_saved(name, "transformer")], tensor), name
        assert tensor.numel() > 0
    assert any(t.abs().max() > 0 for k, t in saved.items() if ".lora_B." in k), "training left B at zero"
    assert (metadata["transformer.r"], metadata["transformer.lora_alpha"]) == (RANK, ALPHA)
    assert (out / "comfyui" / f"{run_dir.name}-{TAG}.safetensors").is_file()

    pipeline = pipelines["tiny-flux"]
    before = generate(pipeline)
    pipeline.load_lora_weights(out / "lora", adapter_name="trained")
    try:
        layer = pipeline.transformer.transformer_blocks[0].attn.to_q
        assert layer.scaling["trained"] == ALPHA / RANK
        after = generate(pipeline)
    finally:
        pipeline.unload_lora_weights()
    assert not torch.allclose(before, after)
    assert torch.equal(generate(pipeline), before)


def flux_comfyui_rows(hidden: int) -> dict[str, tuple[str, int, int]]:
    """diffusers module -> (ComfyUI LoRA name, first row, rows) for tiny-flux's blocks, written out from
    ComfyUI's comfy/utils.py flux_to_diffusers (q, k, v fused in order; a single block's linear1 is
    q, k, v and the 4x wide MLP input)."""
    rows = {}
    for i, part in enumerate(("to_q", "to_k", "to_v")):
        rows[f"transformer_blocks.0.attn.{part}"] = ("lora_unet_double_blocks_0_img_attn_qkv", i * hidden, hidden)
        rows[f"single_transformer_blocks.0.attn.{part}"] = ("lora_unet_single_blocks_0_linear1", i * hidden, hidden)
    for i, part in enumerate(("add_q_proj", "add_k_proj", "add_v_proj")):
        rows[f"transformer_blocks.0.attn.{part}"] = ("lora_unet_double_blocks_0_txt_attn_qkv", i * hidden, hidden)
    rows["single_transformer_blocks.0.proj_mlp"] = ("lora_unet_single_blocks_0_linear1", 3 * hidden, 4 * hidden)
    for diffusers_name, bfl, width in [
        ("attn.to_out.0", "img_attn_proj", hidden), ("attn.to_add_out", "txt_attn_proj", hidden),
        ("ff.net.0.proj", "img_mlp_0", 4 * hidden), ("ff.net.2", "img_mlp_2", hidden),
        ("ff_context.net.0.proj", "txt_mlp_0", 4 * hidden), ("ff_context.net.2", "txt_mlp_2", hidden),
    ]:
        rows[f"transformer_blocks.0.{diffusers_name}"] = (f"lora_unet_double_blocks_0_{bfl}", 0, width)
    return rows


def lora_deltas(state: dict[str, torch.Tensor], scale: float, component: str = "transformer"
                ) -> dict[str, torch.Tensor]:
    """module -> B @ A * scale, from a diffusers-format LoRA state dict."""
    out = {}
    for key, down in state.items():
        if key.endswith(".lora_A.weight"):
            module = key.removeprefix(f"{component}.").removesuffix(".lora_A.weight")
            up = state[key.replace(".lora_A.", ".lora_B.")]
            out[module] = up.float() @ down.float() * scale
    return out


def test_comfyui_flux_lora_is_the_same_update_under_comfyui_names(runs, pipelines, tmp_path):
    from safetensors.torch import load_file

    from zerotrain.export import export

    run_dir = runs / case_name("tiny-flux", 3, "lora")
    out = export(run_dir, out=tmp_path / "out", comfyui=True)
    reference = lora_deltas(load_file(out / "lora" / "pytorch_lora_weights.safetensors"), ALPHA / RANK)
    comfy = load_file(out / "comfyui" / f"{run_dir.name}-{TAG}.safetensors")
    names = {k.rsplit(".", 2)[0] if k.endswith(".weight") else k.rsplit(".", 1)[0] for k in comfy}
    assert all(n.startswith("lora_unet_") for n in names)
    assert set(comfy) == {f"{n}.{s}" for n in names for s in ("lora_down.weight", "lora_up.weight", "alpha")}
    # ComfyUI (and kohya) apply up @ down * alpha / rank, rank = lora_down rows.
    full = {n: comfy[f"{n}.lora_up.weight"].float() @ comfy[f"{n}.lora_down.weight"].float()
            * comfy[f"{n}.alpha"].item() / comfy[f"{n}.lora_down.weight"].shape[0] for n in names}
    rows = flux_comfyui_rows(hidden=32)
    covered = {n: torch.zeros(full[n].shape[0], dtype=torch.bool) for n in names}
    for module, delta in reference.items():
        name, first, height = rows[module]
        torch.testing.assert_close(full[name][first:first + height], delta, rtol=1e-5, atol=1e-6)
        covered[name][first:first + height] = True
    for name, delta in full.items():
        assert not delta[~covered[name]].any(), f"{name}: rows without a LoRA must stay zero"
    assert names == {rows[m][0] for m in reference}

    # diffusers' own kohya converter reads the double-block layers back to the same update (its
    # single-block split assumes FLUX.1's 3072 width, so those are checked above only).
    double = {k: v for k, v in comfy.items() if "double_blocks" in k}
    pipeline = pipelines["tiny-flux"]
    pipeline.load_lora_weights(double, adapter_name="comfy")
    try:
        for module, delta in reference.items():
            if module.startswith("transformer_blocks."):
                layer = pipeline.transformer.get_submodule(module)
                loaded = layer.lora_B["comfy"].weight.float() @ layer.lora_A["comfy"].weight.float()
                torch.testing.assert_close(loaded * layer.scaling["comfy"], delta, rtol=2e-2, atol=1e-4)
    finally:
        pipeline.unload_lora_weights()


@pytest.mark.parametrize("model", ["tiny-sdxl", "tiny-sd3"])
def test_lora_export_of_other_families(runs, pipelines, model):
    from safetensors.torch import load_file

    from zerotrain.export import export

    run_dir = runs / case_name(model, 0, "lora")
    component = "unet" if model == "tiny-sdxl" else "transformer"
    out = export(run_dir, comfyui=True)
    saved = load_file(out / "lora" / "pytorch_lora_weights.safetensors")
    held = engine_weights(run_dir)
    assert saved.keys() == {as_saved(name, component) for name in held}
    assert all(torch.equal(saved[as_saved(n, component)], t) for n, t in held.items())
    comfy = load_file(out / "comfyui" / f"{run_dir.name}-{TAG}.safetensors")
    prefix = "lora_unet_" if model == "tiny-sdxl" else "lora_transformer_"
    module = next(iter(held)).removesuffix(".lora_A.default.weight").removesuffix(".lora_B.default.weight")
    assert f"{prefix}{module.replace('.', '_')}.lora_down.weight" in comfy
    assert len(comfy) == len(held) // 2 * 3

    pipeline = pipelines[model]
    before = generate(pipeline)
    pipeline.load_lora_weights(out / "lora", adapter_name="trained")
    try:
        assert getattr(pipeline, component).get_submodule(module).scaling["trained"] == ALPHA / RANK
        after = generate(pipeline)
    finally:
        pipeline.unload_lora_weights()
    assert not torch.allclose(before, after)
    if model == "tiny-sdxl":
        # diffusers' own converter for kohya "lora_unet_<diffusers path>" keys reads back the same update
        # (it does not read OneTrainer's "lora_transformer_" SD3 names, which ComfyUI maps).
        pipeline.load_lora_weights(comfy, adapter_name="comfy")
        try:
            for key, delta in lora_deltas(saved, ALPHA / RANK, component).items():
                layer = pipeline.unet.get_submodule(key)
                loaded = layer.lora_B["comfy"].weight.float() @ layer.lora_A["comfy"].weight.float()
                torch.testing.assert_close(loaded * layer.scaling["comfy"], delta, rtol=2e-2, atol=1e-4)
        finally:
            pipeline.unload_lora_weights()


# --- LoKr, LoHa, DoRA and init_from (issue 25) -------------------------------------------------------


def peft_delta(held: dict[str, torch.Tensor], module: str, kind: str, scale: float) -> torch.Tensor:
    """A LoKr or LoHa layer's delta from its trained factors, as peft builds it (written out here)."""
    f = {k.removeprefix(module + ".").removesuffix(".default"): v.float() for k, v in held.items()
         if k.startswith(module + ".")}
    if kind == "lokr":
        w1 = f["lokr_w1"] if "lokr_w1" in f else f["lokr_w1_a"] @ f["lokr_w1_b"]
        w2 = f["lokr_w2"] if "lokr_w2" in f else f["lokr_w2_a"] @ f["lokr_w2_b"]
        return torch.kron(w1, w2) * scale
    return (f["hada_w1_a"] @ f["hada_w1_b"]) * (f["hada_w2_a"] @ f["hada_w2_b"]) * scale


@pytest.mark.parametrize("kind", ["lokr", "loha"])
def test_lokr_and_loha_export_a_converted_lora_diffusers_loads_and_comfyui_factors(runs, pipelines, kind):
    """Flux's diffusers loader reads LoRA only: the export writes the LoRA peft's convert_to_lora makes
    (alpha = rank, its fit recorded) and, for ComfyUI, the factors under "transformer.<module>" with the
    scale in the first factor and no alpha (ComfyUI then scales by 1)."""
    from safetensors.torch import load_file

    from zerotrain.export import export

    run_dir = runs / case_name("tiny-flux", 3 if kind == "lokr" else 2, kind)
    out = export(run_dir, TAG, comfyui=True)
    from zerotrain.export import notes

    manifest = json.loads((out / "export.json").read_text())["lora"]
    # export_rank 64 is capped at tiny-flux's narrowest adapted layer (32), which holds every delta exactly.
    assert manifest["type"] == kind and manifest["conversion"]["rank"] == 32
    assert 0 <= manifest["conversion"]["worst_relative_error"] < 0.01
    held = engine_weights(run_dir)
    modules = sorted({k.split(f".{'lokr' if kind == 'lokr' else 'hada'}_")[0] for k in held})
    comfy = load_file(out / "comfyui" / f"{run_dir.name}-{TAG}.safetensors")
    assert not any(k.endswith(".alpha") for k in comfy)
    converted = load_file(out / "lora" / "pytorch_lora_weights.safetensors")
    deltas = lora_deltas(converted, 1.0)
    for module in modules:
        expected = peft_delta(held, module, kind, ALPHA / RANK)
        factors = {k.removeprefix(f"transformer.{module}."): v for k, v in comfy.items()
                   if k.startswith(f"transformer.{module}.")}
        baked = {f"{name}.default": t for name, t in factors.items()}
        tolerance = 1e-2 * float(expected.abs().max())  # bf16 factors
        torch.testing.assert_close(peft_delta({f"{module}.{k}": v for k, v in baked.items()}, module, kind, 1.0),
                                   expected, rtol=0, atol=tolerance)
        torch.testing.assert_close(deltas[module], expected, rtol=0, atol=tolerance)
    assert any(d.abs().max() > 0 for d in deltas.values())
    [note] = notes(out)
    assert f"LoRA of rank 32 converted by peft (diffusers reads no {kind} for" in note
    pipeline = pipelines["tiny-flux"]
    before = generate(pipeline)
    pipeline.load_lora_weights(out / "lora", adapter_name="converted")
    try:
        assert not torch.allclose(before, generate(pipeline))
    finally:
        pipeline.unload_lora_weights()


def test_dora_export_loads_as_dora_and_its_comfyui_file_applies_peft_weights(runs, models, pipelines):
    """diffusers loads the DoRA (lora_magnitude_vector) as DoRA. ComfyUI's weight_decompose, written out
    here, turns the --comfyui file (lora_down/up, alpha, dora_scale (out, 1)) into the weight peft's DoRA
    trains, m (W0 + s B A) / ||W0 + s B A|| per output row, though it divides by ||W0||."""
    from safetensors.torch import load_file

    from zerotrain.export import export

    run_dir = runs / case_name("tiny-flux", 3, "dora")
    out = export(run_dir, TAG, comfyui=True)
    held = engine_weights(run_dir)
    comfy = load_file(out / "comfyui" / f"{run_dir.name}-{TAG}.safetensors")
    base = base_weights(models["tiny-flux"], "transformer")
    module = "transformer_blocks.0.attn.to_q"
    down, up = (held[f"{module}.lora_{x}.default.weight"].float() for x in "AB")
    magnitude = held[f"{module}.lora_magnitude_vector.default.weight"].float()
    w0 = base[f"{module}.weight"].float()
    adapted = w0 + ALPHA / RANK * up @ down
    peft_weight = magnitude[:, None] * adapted / adapted.norm(dim=1, keepdim=True)
    name = f"transformer.{module}"
    c_down, c_up = comfy[f"{name}.lora_down.weight"].float(), comfy[f"{name}.lora_up.weight"].float()
    scale = comfy[f"{name}.alpha"].item() / c_down.shape[0]
    comfy_calc = w0 + scale * c_up @ c_down
    dora_scale = comfy[f"{name}.dora_scale"].float()
    assert dora_scale.shape == (w0.shape[0], 1)
    comfy_weight = comfy_calc * (dora_scale / w0.norm(dim=1, keepdim=True))
    torch.testing.assert_close(comfy_weight, peft_weight, rtol=0, atol=2e-2 * float((peft_weight - w0).abs().max()))

    pipeline = pipelines["tiny-flux"]
    before = generate(pipeline)
    pipeline.load_lora_weights(out / "lora", adapter_name="dora")
    try:
        layer = pipeline.transformer.transformer_blocks[0].attn.to_q
        assert layer.use_dora["dora"] and layer.scaling["dora"] == ALPHA / RANK
        torch.testing.assert_close(layer.lora_magnitude_vector["dora"].weight.float(), magnitude)
        assert not torch.allclose(before, generate(pipeline))
    finally:
        pipeline.unload_lora_weights()


def test_init_from_an_export_then_no_step_exports_the_same_weights(runs):
    """Export, init_from, zero steps, export again: the LoRA is the same, tensor for tensor, with its rank
    and alpha taken from the file."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    from zerotrain.export import export

    first = runs / "first-export" / "lora" / "pytorch_lora_weights.safetensors"
    again = export(runs / case_name("tiny-flux", 0, "init-lora"), TAG) / "lora" / "pytorch_lora_weights.safetensors"
    a, b = load_file(first), load_file(again)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with safe_open(again, "pt") as handle:
        metadata = json.loads(handle.metadata()["lora_adapter_metadata"])
    assert (metadata["transformer.r"], metadata["transformer.lora_alpha"]) == (RANK, ALPHA)


def test_init_from_a_comfyui_export_continues_the_same_update(runs):
    """ComfyUI's Flux names fuse q, k and v (rank 3r there): diffusers' loader splits them and zerotrain
    cuts them back to rank r, so each layer's B A x scale is the file's."""
    from safetensors.torch import load_file

    from zerotrain.export import export

    first = load_file(runs / "first-export" / "lora" / LORA_FILE)
    out = export(runs / case_name("tiny-flux", 0, "init-comfyui"), TAG)
    manifest = json.loads((out / "export.json").read_text())["lora"]
    assert manifest["rank"] == RANK
    again = load_file(out / "lora" / LORA_FILE)
    got = lora_deltas(again, manifest["alpha"] / manifest["rank"])
    expected = {m: d for m, d in lora_deltas(first, ALPHA / RANK).items() if m.startswith("transformer_blocks.")}
    assert expected.keys() == got.keys() and len(got) > 3
    for module, delta in expected.items():
        torch.testing.assert_close(got[module], delta, rtol=2e-2, atol=2e-4)


# --- errors ------------------------------------------------------------------------------------------


def one_line(err: pytest.ExceptionInfo) -> str:
    message = str(err.value)
    assert "\n" not in message
    return message


def test_run_without_checkpoints_is_one_line_error(runs, tmp_path):
    import shutil

    from zerotrain.errors import ZerotrainError
    from zerotrain.export import export, latest_tag

    run_dir = tmp_path / "fresh"
    run_dir.mkdir()
    shutil.copy(runs / case_name("tiny-flux", 0, "lora") / "config.yaml", run_dir / "config.yaml")
    with pytest.raises(ZerotrainError) as err:
        latest_tag(run_dir)
    assert "no checkpoint" in one_line(err)
    with pytest.raises(ZerotrainError) as err:
        export(run_dir)
    assert "no checkpoint" in one_line(err)
    with pytest.raises(ZerotrainError) as err:
        export(tmp_path / "missing")
    assert "config.yaml" in one_line(err)


def test_unknown_tag_is_one_line_error_naming_the_tags(runs):
    from zerotrain.errors import ZerotrainError
    from zerotrain.export import export, latest_tag

    run_dir = runs / case_name("tiny-flux", 0, "lora")
    assert latest_tag(run_dir) == TAG
    with pytest.raises(ZerotrainError) as err:
        export(run_dir, tag="step-00000099")
    assert "step-00000099" in one_line(err) and TAG in str(err.value)


def test_checkpoint_of_another_mode_is_refused(runs, tmp_path):
    """A full checkpoint exported as LoRA (config.yaml changed) has no lora_ tensors."""
    import shutil

    import yaml

    from zerotrain.errors import ZerotrainError
    from zerotrain.export import export

    run_dir = tmp_path / "run"
    shutil.copytree(runs / case_name("tiny-flux", 2, "full"), run_dir)
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    config["training"]["mode"] = "lora"
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(ZerotrainError) as err:
        export(run_dir)
    assert "missing" in one_line(err)


def test_wrapper_prefixes_are_dropped_and_other_sections_are_not_needed(runs, tmp_path):
    """A module saved as "module.<name>" (a wrapped denoiser, diffusers#9393) exports without the
    prefix; a dataset that is gone where the export runs does not matter."""
    import shutil

    import yaml
    from safetensors.torch import load_file

    from zerotrain.export import export

    source = runs / case_name("tiny-flux", 0, "lora")
    run_dir = tmp_path / "run"
    shutil.copytree(source, run_dir)
    states_path = run_dir / "checkpoints" / TAG / "mp_rank_00_model_states.pt"
    states = torch.load(states_path, weights_only=False)
    states["module"] = {f"module.{k}": v for k, v in states["module"].items()}
    torch.save(states, states_path)
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    config["data"]["datasets"] = [{"path": str(tmp_path / "gone")}]
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    exported = load_file(export(run_dir) / "lora" / "pytorch_lora_weights.safetensors")
    assert exported.keys() == load_file(export(source, out=tmp_path / "plain") / "lora" /
                                        "pytorch_lora_weights.safetensors").keys()
    assert not any("module." in k for k in exported)


if __name__ == "__main__":
    sys.exit(worker(Path(sys.argv[1])))
