"""Compile, at image build time, every native op zerotrain's training can load, so that nothing
compiles at a run's first step (the runtime image has no compiler), and check that it worked.

    python prebuild_ops.py patch-deepspeed SRC --march x86-64-v3   # before building DeepSpeed's sdist
    python prebuild_ops.py check-cpu-adam --march x86-64-v3        # after: no AVX-512 in CPU Adam
    python prebuild_ops.py build-quanto                            # optimum-quanto's kernels, in place
    python prebuild_ops.py check                                   # in the runtime image: load them all

Why each step exists:

- DeepSpeed compiles its CPU ops (CPU Adam for optimizer offload, async I/O for NVMe offload)
  with `-march=native` and picks AVX-512 or AVX2 from the *build* machine's CPU. Built on an
  AVX-512 machine, CPU Adam dies with "Illegal instruction" on hosts without it (AMD EPYC
  Rome/Milan, the CPUs of DGX A100 and many cloud A100/H100 nodes). `patch-deepspeed` makes the
  op builders target a named x86-64 level instead: x86-64-v3 (AVX2) runs on every A100/H100 host.
- optimum-quanto compiles its CUDA kernels (fp8 Marlin for a qfloat8 base, AWQ/unpack for qint4)
  and a small C++ op with torch's JIT on first use, into its own package folder. In the image
  that folder is read-only for the non-root user and there is no nvcc. `build-quanto` builds both
  for the image's GPU architectures, with the architecture define a GPU would give (no GPU is
  present during `docker build`), and patches quanto's loader to import a module already built
  for this torch instead of running the JIT build again.
- `check` loads every prebuilt op the way training does; run in the runtime stage, any attempt
  to compile fails the image build instead of a training run.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

# x86-64 microarchitecture level -> DeepSpeed's SIMD define (csrc/includes/simd.h): v3 has AVX2,
# v4 adds AVX-512.
SIMD_FOR_MARCH = {"x86-64-v3": "__AVX256__", "x86-64-v4": "__AVX512__"}

DEEPSPEED_MARKER = "# zerotrain image: CPU ops for a fixed x86-64 level"
QUANTO_MARKER = "# zerotrain image: load a prebuilt module"

# The compute capability quanto derives from the visible GPUs (quanto's get_max_cuda_arch) when
# none is present at build time: every architecture of TORCH_CUDA_ARCH_LIST shares the kernels
# selected for sm_80 (QUANTO_CUDA_ARCH >= 800 enables the AWQ GEMM; Marlin needs >= 8.0).
QUANTO_BUILD_CAPABILITY = (8, 0)


def patch_deepspeed(source: Path, march: str) -> list[Path]:
    """Make every op_builder/builder.py under an unpacked DeepSpeed sdist compile CPU ops for
    `march` (setup.py builds from op_builder/, the wheel ships deepspeed/ops/op_builder/).
    Returns the patched files; raises if there are none or DeepSpeed's builder changed shape."""
    if march not in SIMD_FOR_MARCH:
        raise SystemExit(f"--march {march}: choose one of {', '.join(SIMD_FOR_MARCH)}")
    files = sorted(p for p in source.rglob("op_builder/builder.py") if "class OpBuilder" in p.read_text())
    if not files:
        raise SystemExit(f"{source}: no op_builder/builder.py with class OpBuilder (not a DeepSpeed source tree?)")
    for path in files:
        text = path.read_text()
        if DEEPSPEED_MARKER in text:
            continue
        for method in ("def cpu_arch(self):", "def simd_width(self):"):
            if text.count(method) != 1:
                raise SystemExit(f"{path}: expected one `{method}` in OpBuilder; DeepSpeed changed, "
                                 "update docker/prebuild_ops.py")
        path.write_text(text + f"""

{DEEPSPEED_MARKER} (docker/prebuild_ops.py), not the build machine's
# CPU: -march=native would make CPU Adam use instructions the training hosts may lack.
OpBuilder.cpu_arch = lambda self: "-march={march}"
OpBuilder.simd_width = lambda self: "-D{SIMD_FOR_MARCH[march]}"
""")
    return files


def patch_quanto_loader(extension_py: Path) -> None:
    """Patch optimum-quanto's Extension.lib to import an extension already built for this torch
    (its pytorch_version.txt matches and the module file exists) without torch's JIT build, which
    would need ninja, a compiler, CUDA_HOME and a writable folder, and would rebuild whenever the
    GPU's architecture define differs from the build's."""
    text = extension_py.read_text()
    if QUANTO_MARKER in text:
        return
    anchor = "            os.makedirs(self.build_directory, exist_ok=True)\n"
    if text.count(anchor) != 1 or "version_file" not in text:
        raise SystemExit(f"{extension_py}: optimum-quanto's Extension.lib changed; update docker/prebuild_ops.py")
    fast_path = f"""            {QUANTO_MARKER} for this torch (docker/prebuild_ops.py)
            if os.path.exists(version_file) and os.path.exists(
                os.path.join(self.build_directory, self.name + ".so")
            ):
                from torch.utils.cpp_extension import _import_module_from_library

                self._lib = _import_module_from_library(self.name, self.build_directory, True)
                return self._lib
"""
    extension_py.write_text(text.replace(anchor, fast_path + anchor))


def pretend_gpu(capability: tuple[int, int]) -> None:
    """Make quanto's get_max_cuda_arch see one GPU of `capability` (none is present in `docker build`),
    so that its -DQUANTO_CUDA_ARCH define selects the kernels that GPU would get."""
    import torch

    arch_list = os.environ.get("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
    archs = [f"sm_{a.replace('.', '').removesuffix('+PTX')}" for a in re.split(r"[;\s]+", arch_list) if a]
    torch.cuda.get_arch_list = lambda: archs
    torch.cuda.device_count = lambda: 1
    torch.cuda.get_device_capability = lambda device=None: capability


def build_quanto() -> None:
    pretend_gpu(QUANTO_BUILD_CAPABILITY)
    from optimum.quanto.library import extensions

    patch_quanto_loader(Path(extensions.__file__).with_name("extension.py"))
    importlib.import_module("optimum.quanto.library.extensions.cuda")  # registers quanto_cuda without a GPU
    for name in ("quanto_cpp", "quanto_cuda"):
        print(f"building {name} ...", flush=True)
        lib = extensions.get_extension(name).lib
        print(f"built {name}: {lib.__file__}", flush=True)


def uses_avx512(shared_object: Path) -> bool:
    """Whether a compiled op holds AVX-512 instructions (zmm registers), by its disassembly (binutils)."""
    listing = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(shared_object)], check=True,
                             capture_output=True, text=True).stdout
    return "%zmm" in listing


def check_cpu_adam(march: str, site_packages: Path | None = None) -> Path:
    """The installed CPU Adam op, checked to hold no AVX-512 instructions when built for x86-64-v3."""
    if site_packages is None:
        spec = importlib.util.find_spec("deepspeed")  # locates the package without importing it
        site_packages = Path(spec.origin).parents[1]
    built = sorted((site_packages / "deepspeed" / "ops" / "adam").glob("cpu_adam_op*.so"))
    if not built:
        raise SystemExit(f"no prebuilt CPU Adam under {site_packages}/deepspeed/ops/adam: it would compile at "
                         "the first offloaded step")
    if march == "x86-64-v3" and uses_avx512(built[0]):
        raise SystemExit(f"{built[0]} uses AVX-512 (zmm registers) although it was built for x86-64-v3")
    return built[0]


def check() -> None:
    """Load every prebuilt op as training would, with the CUDA accelerator (no GPU is needed to load)."""
    os.environ["DS_ACCELERATOR"] = "cuda"
    import torch
    from deepspeed.git_version_info import installed_ops
    from deepspeed.ops.op_builder import AsyncIOBuilder, FusedAdamBuilder
    from deepspeed.ops.op_builder.cpu import CPUAdamBuilder

    print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), DeepSpeed prebuilt ops: "
          f"{sorted(name for name, built in installed_ops.items() if built)}")
    for builder in (CPUAdamBuilder(), FusedAdamBuilder(), AsyncIOBuilder()):
        if not installed_ops.get(builder.name):
            raise SystemExit(f"DeepSpeed op {builder.name} was not prebuilt: it would compile at the first step")
        module = builder.load(verbose=False)
        print(f"loaded {builder.name}: {module.__file__}")
    from optimum.quanto.library import extensions

    importlib.import_module("optimum.quanto.library.extensions.cuda")
    for name in ("quanto_cpp", "quanto_cuda"):
        print(f"loaded {name}: {extensions.get_extension(name).lib.__file__}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    steps = parser.add_subparsers(dest="step", required=True)
    p = steps.add_parser("patch-deepspeed", help="target a fixed x86-64 level in an unpacked DeepSpeed sdist")
    p.add_argument("source", type=Path)
    p.add_argument("--march", default="x86-64-v3", help=f"one of {', '.join(SIMD_FOR_MARCH)}")
    a = steps.add_parser("check-cpu-adam", help="check the installed CPU Adam op holds no AVX-512 for x86-64-v3")
    a.add_argument("--march", default="x86-64-v3", help=f"one of {', '.join(SIMD_FOR_MARCH)}")
    steps.add_parser("build-quanto", help="build optimum-quanto's C++ and CUDA extensions in place")
    steps.add_parser("check", help="load every prebuilt op (fails if one would compile)")
    args = parser.parse_args(argv)
    if args.step == "patch-deepspeed":
        for path in patch_deepspeed(args.source, args.march):
            print(f"patched {path}: CPU ops for -march={args.march}")
    elif args.step == "check-cpu-adam":
        print(f"CPU Adam for {args.march}: {check_cpu_adam(args.march)}")
    elif args.step == "build-quanto":
        build_quanto()
    else:
        check()
    return 0


if __name__ == "__main__":
    sys.exit(main())
