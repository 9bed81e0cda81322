#!/usr/bin/env bash
# A Python 3.11 base image made here, for machines that cannot pull python:3.11-slim from Docker
# Hub: Debian bookworm (minbase) from the Debian mirror, with the host's CA bundle so that pip in
# the image trusts the same certificates as pip on the host. Built once; an existing image of the
# same name is kept (delete it with `docker rmi NAME` to rebuild).
#   docker/local_base.sh [NAME]     (default deepinfer-base:bookworm; needs root and debootstrap)
set -euo pipefail
name=${1:-deepinfer-base:bookworm}
if docker image inspect "$name" >/dev/null 2>&1; then
  echo "base image $name exists"
  exit 0
fi
root=$(mktemp -d /tmp/deepinfer-base.XXXXXX)
trap 'rm -rf "$root"' EXIT
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$root" \
  "${DEEPINFER_DEBIAN_MIRROR:-http://deb.debian.org/debian}" >/dev/null
cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/ca-certificates.crt"
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
tar -C "$root" -c . | docker import -c 'ENV LANG=C.UTF-8' - "$name" >/dev/null
echo "base image $name built"
