#!/usr/bin/env bash
# The image's entrypoint: `docker run IMAGE plan ...` runs `zerotrain plan ...`; a first argument that
# is not a zerotrain command or option (deepspeed, torchrun, python, bash, ...) runs as given.
#
# OMP_NUM_THREADS, unless set: the CPU cores this container may use divided by its GPUs, one share per
# rank. Unset, every rank would start a thread per core (8 ranks oversubscribe the CPU 8 times), and
# torchrun would set 1, which starves DeepSpeed's CPU Adam (optimizer offload) of its threads.
set -euo pipefail

if [[ -z "${OMP_NUM_THREADS:-}" ]]; then
    cores=$(nproc)
    gpus=0
    if command -v nvidia-smi >/dev/null 2>&1; then
        gpus=$(nvidia-smi --list-gpus 2>/dev/null | grep -c '^GPU' || true)
    fi
    OMP_NUM_THREADS=$(( cores / (gpus > 0 ? gpus : 1) ))
    export OMP_NUM_THREADS=$(( OMP_NUM_THREADS > 0 ? OMP_NUM_THREADS : 1 ))
fi

case "${1:-}" in
    ""|-*|plan|cache|train|export|launch|doctor)
        exec zerotrain "$@" ;;
    *)
        exec "$@" ;;
esac
