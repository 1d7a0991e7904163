#!/bin/sh
# The image base built from Debian packages, for machines that reach Debian's archive
# but no container registry: debootstrap --variant=minbase bookworm with python3,
# trimmed (no apt lists or caches, docs, man pages, locales) and imported into podman.
#
#   deploy/image/build-base.sh [TAG]        (default localhost/mlwe-base:bookworm)
#
# Cached: an image with TAG built from this same script is reused (its label carries a
# digest of this file), so a machine debootstraps once. Needs root and debootstrap.
# DEBIAN_MIRROR: the archive to bootstrap from (default http://deb.debian.org/debian).
set -eu

TAG=${1:-localhost/mlwe-base:bookworm}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
SUITE=bookworm
PACKAGES=python3,python3-venv,ca-certificates
RECIPE=$(sha256sum "$0" | cut -c1-16)
LABEL=org.mlwe.base-recipe

if podman image exists "$TAG" \
   && [ "$(podman image inspect --format "{{index .Labels \"$LABEL\"}}" "$TAG")" = "$RECIPE" ]; then
  echo "base image $TAG: cached (recipe $RECIPE)"
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "building the base image $TAG needs root (debootstrap); or pass BASE=<an image with python3>" >&2
  exit 1
fi
command -v debootstrap >/dev/null || { echo "debootstrap is not installed (apt-get install debootstrap)" >&2; exit 1; }

WORK=$(mktemp -d /var/tmp/mlwe-base.XXXXXX)
trap 'rm -rf "$WORK"' EXIT INT TERM
ROOT="$WORK/rootfs"
echo "base image $TAG: debootstrap $SUITE ($PACKAGES) from $MIRROR"
debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$ROOT" "$MIRROR" > "$WORK/debootstrap.log" 2>&1 \
  || { tail -30 "$WORK/debootstrap.log" >&2; exit 1; }

# what a running server never reads; later apt installs in a derived image skip them too
cat > "$ROOT/etc/dpkg/dpkg.cfg.d/01-mlwe-slim" <<'CFG'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
path-exclude /usr/share/lintian/*
CFG
find "$ROOT/usr/share/doc" -mindepth 1 -not -name copyright -not -type d -delete
find "$ROOT/usr/share/doc" -mindepth 1 -type d -empty -delete
rm -rf "$ROOT"/usr/share/man/* "$ROOT"/usr/share/info/* "$ROOT"/usr/share/locale/* \
       "$ROOT"/usr/share/lintian/* "$ROOT"/var/cache/apt/* "$ROOT"/var/lib/apt/lists/* \
       "$ROOT"/var/cache/debconf/*-old "$ROOT"/var/log/* "$ROOT"/tmp/* "$ROOT"/root/.cache

tar --numeric-owner -C "$ROOT" -cf - . | podman import \
  --change "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" \
  --change "ENV LANG=C.UTF-8" \
  --change "LABEL $LABEL=$RECIPE" \
  --change 'CMD ["/bin/bash"]' \
  --message "debootstrap --variant=minbase $SUITE + $PACKAGES" - "$TAG" > /dev/null
echo "base image $TAG: built ($(podman image inspect --format '{{.Size}}' "$TAG") bytes)"
