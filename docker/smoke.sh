#!/usr/bin/env bash
# Smoke-test a built zerotrain image without a GPU, as its non-root user (uid 1000), through its
# entrypoint, from the repository root:
#
#   docker/smoke.sh [IMAGE]        (default zerotrain:0.1.0)
#
# 1. prebuild_ops.py check: every compiled op loads, with no compiler in the image;
# 2. zerotrain doctor --json: parses, and says there is no NVIDIA driver, without a traceback;
# 3. zerotrain plan for a catalog model (flux-dev, full fine-tune on 8xA100-80GB);
# 4. the README's tiny CPU demo on 2 ranks (DS_ACCELERATOR=cpu, examples/ mounted read-only, Adafactor,
#    since DeepSpeed's CPU-accelerator Adam would need a compiler), then its export loads in diffusers.
# Every step's exit code is checked; the first failure stops it. Uses docker where a daemon answers,
# buildah (a working container of the image) otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
IMAGE="${1:-zerotrain:0.1.0}"
RUNS="$(mktemp -d /var/tmp/zerotrain-smoke.XXXXXX)"
chmod 777 "$RUNS"
MOUNTS=(-v "$PWD/examples:/workspace/examples:ro" -v "$RUNS:/workspace/runs")

if docker info >/dev/null 2>&1; then
    run() { docker run --rm --user 1000:1000 --ipc=host "${MOUNTS[@]}" -e DS_ACCELERATOR=cpu "$IMAGE" "$@"; }
else
    CTR="$(buildah from "$IMAGE")"
    trap 'buildah rm "$CTR" >/dev/null; rm -rf "$RUNS"' EXIT
    run() {
        buildah run --isolation chroot --user 1000:1000 --workingdir /workspace "${MOUNTS[@]}" \
            --env DS_ACCELERATOR=cpu "$CTR" -- zerotrain-entrypoint "$@"
    }
fi

step() {
    local name="$1"
    shift
    local start=$SECONDS
    echo "--- $name"
    "$@"
    echo "--- $name: ok ($((SECONDS - start)) s)"
}

step "ops load" run python /opt/zerotrain-docker/prebuild_ops.py check
doctor_json() {
    local out rc=0
    out="$(run doctor --json --gpus 8xA100-80GB 2>"$RUNS/doctor.err")" || rc=$?
    if grep -q Traceback "$RUNS/doctor.err"; then cat "$RUNS/doctor.err" >&2; return 1; fi
    python3 -c 'import json, sys; checks = json.loads(sys.argv[1])["checks"]; \
        versions = next(c for c in checks if c["name"] == "versions"); \
        assert "no NVIDIA driver" in versions["detail"], versions; print(versions["detail"])' "$out"
    echo "doctor exit code $rc (a check that needs a GPU is not ok here)"
}
step "doctor" doctor_json
step "plan" run plan --model flux-dev --resolution 1024 --gpus 8xA100-80GB --mode full
step "tiny CPU training, 2 ranks" run deepspeed --num_gpus 2 --module zerotrain.train \
    --config examples/tiny-cpu.yaml --set output_dir=runs/tiny-cpu --set data.cache_dir=runs/tiny-cpu/cache \
    --set optimizer.name=adafactor --set training.max_steps=4 --set training.checkpoint_every=2
step "export loads" run python -c 'from diffusers import FluxTransformer2DModel; \
    FluxTransformer2DModel.from_pretrained("runs/tiny-cpu/export/transformer"); print("export loads")'
echo "smoke test of $IMAGE passed"
