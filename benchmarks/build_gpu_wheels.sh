#!/usr/bin/env bash
# The wheels a GPU node without network needs to run benchmarks/gpu_check.py (and gpu_suite.py), for
# the node's Python (cp312, manylinux x86_64), and a check that they and the project stay under the
# 64 MiB that may be carried to the node (issue 38). The node's image has torch 2.11 (CUDA), nvcc,
# transformers, peft, accelerate, safetensors, pyyaml, psutil, msgpack, ninja, py-cpuinfo,
# nvidia-ml-py (../shared/gpu-measurements/2026-11-28-h200/README.md); it lacks the rest below.
#
#     benchmarks/build_gpu_wheels.sh [FOLDER]     # default: .whl at the repository's root (git-ignored)
#
# Versions: deepspeed, diffusers, peft and optimum-quanto as zerotrain/versions.py's TESTED; the
# others as installed in this checkout's .venv (the environment the suite passes in). DeepSpeed
# publishes only a source archive: its wheel is built here with no ops (DS_BUILD_OPS=0), a pure
# Python wheel; the node compiles FusedAdam itself (gpu_check's build-fused-adam case).
# On the node (benchmarks/README.md, "The GPU check"):
#     python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-.whl}
PY=${PYTHON:-.venv/bin/python}
LIMIT=$((64 * 1024 * 1024))
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)

# name==version for each package: TESTED's for the four zerotrain reaches into, this venv's otherwise.
mapfile -t PINS < <("$PY" - <<'EOF'
from importlib.metadata import version
from zerotrain.versions import TESTED
# What the node lacks (pydantic and its parts, hjson for DeepSpeed, importlib_metadata for
# diffusers, pytest for the gpu-marked tests: its pygments and packaging come with the node's rich and
# transformers), and transformers and peft at the versions tested.
OTHERS = ("transformers", "pydantic", "pydantic-core", "annotated-types", "typing-inspection",
          "typing-extensions", "hjson", "importlib-metadata", "pytest", "pluggy", "iniconfig")
for name in ("deepspeed", "diffusers", "peft", "optimum-quanto"):
    print(f"{name}=={TESTED[name][0]}")
for name in OTHERS:
    print(f"{name}=={version(name)}")
EOF
)
mkdir -p "$OUT"
rm -f "$OUT"/*.whl  # one version of each: two stop the node's install
for pin in "${PINS[@]}"; do
    if [[ $pin == deepspeed==* ]]; then
        DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$OUT" "$pin"
    else
        "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            "${PLATFORMS[@]}" -d "$OUT" "$pin"
    fi
done

# What travels: the project as git tracks it, the untracked files git does not ignore, and the wheels.
project=$(git archive --format=tar HEAD | wc -c)
untracked=$(git ls-files -z --others --exclude-standard | xargs -0 -r du -cb 2>/dev/null | awk 'END {print $1+0}')
wheels=$(du -cb "$OUT"/*.whl | tail -1 | cut -f1)
total=$((project + untracked + wheels))
ls -1 "$OUT"
mib() { awk -v b="$1" 'BEGIN {printf "%.1f MiB", b / 1048576}'; }
echo "project $(mib "$project") + untracked $(mib "$untracked") + ${#PINS[@]} wheels $(mib "$wheels") = $(mib "$total") of $(mib "$LIMIT")"
if ((total > LIMIT)); then
    echo "build_gpu_wheels: $(mib "$total") exceeds the $(mib "$LIMIT") that may travel to the node: drop a wheel" \
        "the node has, or commit/ignore untracked files" >&2
    exit 1
fi
