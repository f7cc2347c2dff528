#!/usr/bin/env bash
# Build the zerotrain image from the repository root, with `docker build` where a daemon answers and
# with buildah otherwise (no daemon, no root daemon socket: --isolation chroot, Docker's image format).
#
#   docker/build.sh [--local-base] [--tag NAME] [--arch "8.0;9.0"] [--ca-cert FILE]
#
#   --local-base   build from a Debian trixie base made here with debootstrap (Debian's mirror) and
#                  CUDA 13 from PyPI's wheels, for a machine that reaches no container registry; the
#                  image then needs an R580+ driver (the default image: R525+)
#   --tag NAME     the image's name (default zerotrain:0.1.0, or zerotrain:0.1.0-local)
#   --arch LIST    TORCH_CUDA_ARCH_LIST, e.g. "9.0" for H100 only (faster to build; default "8.0;9.0")
#   --ca-cert FILE a TLS-intercepting proxy's CA bundle for pip during the build (buildah: mounted for
#                  the build only, never in a layer)
#
# It prints each stage's build time and the image's size at the end.
set -euo pipefail
cd "$(dirname "$0")/.."

TAG="" LOCAL=0 ARCH="" CA=""
while [ $# -gt 0 ]; do
    case "$1" in
        --local-base) LOCAL=1 ;;
        --tag) TAG="$2"; shift ;;
        --arch) ARCH="$2"; shift ;;
        --ca-cert) CA="$(realpath "$2")"; shift ;;
        -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
        *) echo "docker/build.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done
[ -n "$TAG" ] || TAG="zerotrain:0.1.0$([ "$LOCAL" = 1 ] && echo -local)"

if docker info >/dev/null 2>&1; then
    TOOL=docker
elif command -v buildah >/dev/null; then
    TOOL=buildah
else
    echo "docker/build.sh: neither a running docker daemon nor buildah; install one (apt-get install buildah)" >&2
    exit 2
fi

ARGS=(--build-arg "USER_UID=1000")
[ -z "$ARCH" ] || ARGS+=(--build-arg "TORCH_CUDA_ARCH_LIST=$ARCH")
if [ -n "$CA" ]; then
    if [ "$TOOL" = docker ]; then
        echo "docker/build.sh: --ca-cert needs buildah (docker build cannot mount a host file into RUN steps)" >&2
        exit 2
    fi
    ARGS+=(--volume "$CA:/run/zerotrain-ca.pem:ro" --build-arg "PIP_CERT=/run/zerotrain-ca.pem")
fi

image_exists() {
    if [ "$TOOL" = docker ]; then docker image inspect "$1" >/dev/null 2>&1; else buildah inspect --type image "$1" >/dev/null 2>&1; fi
}

if [ "$LOCAL" = 1 ]; then
    # Debian trixie's python3.13, and torch's CUDA 13.0 wheels from PyPI with the cuda-toolkit release
    # they require (torch 2.13.0: cuda-toolkit 13.0.3), whose nvcc compiles the ops.
    BASE=localhost/zerotrain-debian:trixie
    if ! image_exists "$BASE"; then
        WORK="$(mktemp -d /var/tmp/zerotrain-base.XXXXXX)"
        trap 'rm -rf "$WORK"' EXIT
        start=$SECONDS
        debootstrap --variant=minbase trixie "$WORK/rootfs" http://deb.debian.org/debian >"$WORK/debootstrap.log"
        tar -C "$WORK/rootfs" -cf "$WORK/rootfs.tar" .
        if [ "$TOOL" = docker ]; then
            docker import "$WORK/rootfs.tar" "$BASE" >/dev/null
        else
            ctr="$(buildah from scratch)"
            buildah add "$ctr" "$WORK/rootfs.tar" / >/dev/null
            buildah commit --quiet "$ctr" "$BASE" >/dev/null
            buildah rm "$ctr" >/dev/null
        fi
        echo "base $BASE (debootstrap): $((SECONDS - start)) s"
    fi
    ARGS+=(--build-arg "BUILDER_IMAGE=$BASE" --build-arg "RUNTIME_IMAGE=$BASE" --build-arg "PYTHON_VERSION=3.13"
           --build-arg "TORCH_INDEX_URL=https://pypi.org/simple" --build-arg "TORCH_LOCAL=" --build-arg "TORCH_CUDA=cu130"
           --build-arg "CUDA_TOOLKIT_WHEELS=13.0.3")
fi

build() {  # build TARGET TAG
    if [ "$TOOL" = docker ]; then
        docker build -f docker/Dockerfile --target "$1" -t "$2" "${ARGS[@]}" .
    else
        buildah bud --layers --format docker --isolation chroot -f docker/Dockerfile --target "$1" -t "$2" \
            "${ARGS[@]}" .
    fi
}

start=$SECONDS
build builder "$TAG-builder"
builder_s=$((SECONDS - start))
start=$SECONDS
build runtime "$TAG"
runtime_s=$((SECONDS - start))
if [ "$TOOL" = docker ]; then
    size="$(docker image inspect --format '{{.Size}}' "$TAG") bytes"
else
    size="$(buildah images --noheading --format '{{.Size}}' "$TAG")"
fi
echo "built $TAG with $TOOL: builder stage $builder_s s, runtime stage $runtime_s s, image size $size"
