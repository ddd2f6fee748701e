#!/usr/bin/env bash
# Build ops/Dockerfile with Debian's buildah, on a machine that has no Docker engine and may reach
# no container registry.
#
#   ops/build-image.sh                 # proxy and judge: localhost/ratchet:0.1.0
#   ops/build-image.sh --learner       # + learner and CPU torch: localhost/ratchet:0.1.0-cpu
#
# Without PYTHON_IMAGE the base is made here: a Debian bookworm root filesystem from debootstrap
# (python3, venv, python-is-python3, ca-certificates, passwd), imported as
# localhost/ratchet-base:bookworm and reused by later runs (REBUILD_BASE=1 makes it again).
# With PYTHON_IMAGE (e.g. the python:...-slim-bookworm the Dockerfile names) that base is used.
#
# Environment: PYTHON_IMAGE, IMAGE (the tag), EXTRAS, TORCH_VERSION, TORCH_INDEX_URL,
# TORCH_FIND_LINKS (a folder of wheels on this machine, mounted read-only into the build),
# REBUILD_BASE. Installs buildah, podman and debootstrap with apt-get when they are missing.
set -euo pipefail
cd "$(dirname "$0")/.."

learner=0
for arg in "$@"; do
  case "$arg" in
    --learner) learner=1 ;;
    -h | --help) sed -n '2,16p' "$0"; exit 0 ;;
    *) echo "unknown argument: $arg" >&2; exit 2 ;;
  esac
done

version="$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml | head -1)"
base_tag="localhost/ratchet-base:bookworm"

ensure_tools() {
  local missing=()
  command -v buildah >/dev/null || missing+=(buildah)
  command -v podman >/dev/null || missing+=(podman)
  command -v debootstrap >/dev/null || missing+=(debootstrap)
  [ "${#missing[@]}" -eq 0 ] && return 0
  echo "==> installing ${missing[*]} with apt-get"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    "${missing[@]}" crun uidmap fuse-overlayfs netavark >/dev/null
}

# The local base: what python:*-slim-bookworm gives the Dockerfile (python on PATH as `python`,
# venv, CA certificates, groupadd/useradd), from Debian's own packages.
make_base() {
  local root tarball
  root="$(mktemp -d /var/tmp/ratchet-base.XXXXXX)"
  tarball="$root.tar"
  # shellcheck disable=SC2064  # expand now: the paths are local to this function
  trap "rm -rf '$root' '$tarball'" RETURN
  echo "==> debootstrap bookworm (minbase) into $root"
  # debootstrap's own default mirror unless DEBIAN_MIRROR names another.
  debootstrap --variant=minbase \
    --include=python3,python3-venv,python-is-python3,ca-certificates,passwd \
    bookworm "$root" ${DEBIAN_MIRROR:+"$DEBIAN_MIRROR"} >/dev/null
  # Package indexes and caches are build-time only; an image needs none of them.
  rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/cache/apt/archives/*.deb \
    "$root"/var/cache/debconf/*-old
  echo "==> base $base_tag: $(chroot "$root" python --version)"
  tar --numeric-owner -C "$root" -cf "$tarball" .
  podman import --quiet \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["python3"]' \
    "$tarball" "$base_tag" >/dev/null
}

ensure_tools

if [ -z "${PYTHON_IMAGE:-}" ]; then
  if [ "${REBUILD_BASE:-0}" = 1 ] || ! podman image exists "$base_tag"; then
    make_base
  else
    echo "==> reusing $base_tag (REBUILD_BASE=1 makes it again)"
  fi
  PYTHON_IMAGE="$base_tag"
fi

build_args=(--build-arg "PYTHON_IMAGE=$PYTHON_IMAGE")
volumes=()
if [ "$learner" = 1 ]; then
  EXTRAS="${EXTRAS:-judge,learner}"
  # The learner here trains on the CPU: torch's CPU wheel, from a local folder of wheels when
  # this machine has one (pip's find-links), else from PyTorch's CPU index.
  TORCH_VERSION="${TORCH_VERSION:-2.13.0+cpu}"
  if [ -z "${TORCH_FIND_LINKS:-}" ]; then
    TORCH_FIND_LINKS="$(pip config get global.find-links 2>/dev/null || true)"
  fi
  if [ -n "$TORCH_FIND_LINKS" ] && compgen -G "$TORCH_FIND_LINKS/torch-${TORCH_VERSION}-*.whl" >/dev/null; then
    # Empty: pip's default index, where torch's own dependencies (sympy, networkx, ...) are.
    TORCH_INDEX_URL="${TORCH_INDEX_URL:-}"
    volumes+=(-v "$TORCH_FIND_LINKS:$TORCH_FIND_LINKS:ro")
    build_args+=(--build-arg "TORCH_FIND_LINKS=$TORCH_FIND_LINKS")
  else
    TORCH_INDEX_URL="${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}"
  fi
  build_args+=(--build-arg "TORCH_VERSION=$TORCH_VERSION" --build-arg "TORCH_INDEX_URL=$TORCH_INDEX_URL")
  IMAGE="${IMAGE:-localhost/ratchet:$version-cpu}"
else
  IMAGE="${IMAGE:-localhost/ratchet:$version}"
fi
build_args+=(--build-arg "EXTRAS=${EXTRAS:-judge}")

# A machine behind a TLS-inspecting egress proxy trusts its CA in the system bundle; pip in the
# build must too. Mounted for the build's RUN steps only: it never lands in a layer.
host_ca="${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}"
if [ -f "$host_ca" ]; then
  volumes+=(-v "$host_ca:/run/host-ca.crt:ro")
  build_args+=(--build-arg "PIP_CERT=/run/host-ca.crt")
fi

echo "==> building $IMAGE on $PYTHON_IMAGE"
start=$SECONDS
# --isolation chroot: RUN steps without an OCI runtime. Here both fail to start a container:
# crun refuses cgroups in hybrid mode (v1 controllers plus hugetlb on the v2 hierarchy), and
# runc cannot apply the rlimits podman asks for (nofile 1048576 over this VM's hard 20000, with
# no CAP_SYS_RESOURCE to raise it). --network host: RUN steps only need egress to PyPI, and need
# no bridge (netavark, iptables; one works here, a CI VM may refuse it). --pull=false: a local
# base is in no registry. --force-rm: a failed build leaves no working container behind.
buildah bud \
  --isolation "${BUILDAH_ISOLATION:-chroot}" \
  --file ops/Dockerfile \
  --ignorefile ops/Dockerfile.dockerignore \
  --network host \
  --pull=false \
  --layers \
  --force-rm \
  "${volumes[@]}" \
  "${build_args[@]}" \
  --tag "$IMAGE" \
  .
echo "==> built $IMAGE in $((SECONDS - start)) s: $(podman image inspect --format '{{.Size}}' "$IMAGE") bytes"
