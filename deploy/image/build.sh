#!/bin/sh
# Build the mlwe server image with podman (what `make image` runs).
#
#   deploy/image/build.sh [serve|full]
#
# serve: the core install (engine, API, dashboard, store, bus), tagged IMAGE:VERSION and
#        IMAGE:latest; full: with FULL_EXTRAS as well, tagged IMAGE:VERSION-full and IMAGE:full.
# IMAGE  default localhost/mlwe
# BASE   the base image; default localhost/mlwe-base:bookworm, built here from Debian
#        packages (deploy/image/build-base.sh, cached) since no registry may be reachable.
#        Elsewhere: BASE=docker.io/library/python:3.11-slim-bookworm (the Containerfile's own default).
# PIP_INDEX_URL, PIP_EXTRA_INDEX_URL, PIP_TRUSTED_HOST: passed to pip in the build when set;
# PIP_CERT (else pip's global.cert): a CA bundle passed as the build secret pip-cert.
# The build runs with --isolation chroot (it needs no cgroups or user namespaces).
set -eu
cd "$(dirname "$0")/../.."

VARIANT=${1:-serve}
IMAGE=${IMAGE:-localhost/mlwe}
LOCAL_BASE=localhost/mlwe-base:bookworm
BASE=${BASE:-$LOCAL_BASE}
FULL_EXTRAS=${FULL_EXTRAS:-reports,pipelines,postgres,nats}
VERSION=$(sed -n 's/^version = "\(.*\)"$/\1/p' pyproject.toml | head -1)

case "$VARIANT" in
  serve) EXTRAS=""; TAGS="$IMAGE:$VERSION $IMAGE:latest" ;;
  full) EXTRAS=$FULL_EXTRAS; TAGS="$IMAGE:$VERSION-full $IMAGE:full" ;;
  *) echo "usage: $0 [serve|full]" >&2; exit 2 ;;
esac
for tool in podman buildah; do
  command -v "$tool" >/dev/null || { echo "$tool is not installed (make image-tools, or apt-get install podman buildah)" >&2; exit 1; }
done
if [ "$BASE" = "$LOCAL_BASE" ]; then
  deploy/image/build-base.sh "$BASE"
fi

PULL=missing
[ "$BASE" != "$LOCAL_BASE" ] || PULL=never  # local only: never ask a registry for it
set -- --isolation chroot --format docker --layers --pull="$PULL" \
  --build-arg BASE="$BASE" --build-arg EXTRAS="$EXTRAS" -f Containerfile
for v in PIP_INDEX_URL PIP_EXTRA_INDEX_URL PIP_TRUSTED_HOST; do
  eval "val=\${$v:-}"
  [ -z "$val" ] || set -- "$@" --build-arg "$v=$val"
done
# the CA bundle pip trusts here (a mirror's, or a TLS-inspecting proxy's), as a build
# secret: the image's own CA store does not know it, and no layer keeps it
CERT=${PIP_CERT:-$(python3 -m pip config get global.cert 2>/dev/null || true)}
[ -z "$CERT" ] || [ ! -f "$CERT" ] || set -- "$@" --secret "id=pip-cert,src=$CERT"
for t in $TAGS; do set -- "$@" -t "$t"; done
echo "building $TAGS on $BASE${EXTRAS:+ with extras $EXTRAS}"
podman build "$@" .
FIRST=${TAGS%% *}
SIZE=$(podman image inspect --format '{{.Size}}' "$FIRST")
echo "$FIRST: $SIZE bytes ($((SIZE / 1000000)) MB)"
