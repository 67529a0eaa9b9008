#!/usr/bin/env bash
# Build the podman backend's base image (Debian bookworm minbase + python3, about 90 s) once:
# an existing image is kept. Offline container registries are not needed: the root filesystem
# comes from debootstrap, using the Debian mirror this machine's apt already uses.
#   scripts/podman_image.sh [IMAGE]     (default: $PI_ENV_PODMAN_IMAGE or localhost/pi-env-base:bookworm)
#   PI_ENV_PODMAN_REBUILD=1 scripts/podman_image.sh     rebuilds it.
# Installs podman, runc and debootstrap with apt when they are missing (Debian/Ubuntu, as root).
set -euo pipefail
IMAGE="${1:-${PI_ENV_PODMAN_IMAGE:-localhost/pi-env-base:bookworm}}"
PACKAGES="python3,ca-certificates"

missing=()
for tool in podman runc debootstrap; do command -v "$tool" >/dev/null || missing+=("$tool"); done
if ((${#missing[@]})); then
    echo "installing ${missing[*]} with apt-get" >&2
    apt-get update -q >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >/dev/null
fi

if podman image exists "$IMAGE" && [[ -z "${PI_ENV_PODMAN_REBUILD:-}" ]]; then
    echo "podman image $IMAGE exists (PI_ENV_PODMAN_REBUILD=1 to rebuild)" >&2
    exit 0
fi

# The mirror apt already uses here (deb822 "URIs:" or one-line "deb URL suite ..." sources).
mirror="${PI_ENV_DEBIAN_MIRROR:-}"
if [[ -z "$mirror" ]]; then
    mirror=$(grep -hsE '^(URIs:|deb )' /etc/apt/sources.list.d/*.sources /etc/apt/sources.list.d/*.list \
                 /etc/apt/sources.list | grep -v security | head -n1 |
             sed -E 's/^URIs:[[:space:]]*//; s/^deb[[:space:]]+(\[[^]]*\][[:space:]]+)?//; s/[[:space:]].*//' || true)
fi
[[ -n "$mirror" ]] || { echo "no Debian mirror found in apt sources: set PI_ENV_DEBIAN_MIRROR" >&2; exit 1; }

root=$(mktemp -d /var/tmp/pi-env-rootfs.XXXXXX)
trap 'rm -rf --one-file-system "$root"' EXIT
echo "debootstrap bookworm ($PACKAGES) from $mirror ..." >&2
debootstrap --variant=minbase --include="$PACKAGES" bookworm "$root" "$mirror" >"$root.log" 2>&1 \
    || { tail -n 20 "$root.log" >&2; rm -f "$root.log"; exit 1; }
rm -f "$root.log"
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
tar -C "$root" -c . | podman import --change 'CMD ["/bin/bash"]' - "$IMAGE" >/dev/null
echo "built podman image $IMAGE" >&2
