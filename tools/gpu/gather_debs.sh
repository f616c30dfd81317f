#!/usr/bin/env bash
# On a Debian 12 (amd64) machine with network: downloads the .deb files a CUDA build of
# lorastream needs on a machine that has CUDA and a torch wheel but none of our other
# dependencies, into the git-ignored folder .debs/ (carry it to the CUDA machine).
# Usage: tools/gpu/gather_debs.sh [DEST]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
DEST="${1:-$ROOT/.debs}"
mkdir -p "$DEST"
# Build-time only: headers, CMake configs and the shared libraries we link (with the
# libraries those need at link time). LibTorch comes from the torch wheel there.
PACKAGES=(
  libboost1.74-dev libboost-dev
  libzmq3-dev libzmq5 cppzmq-dev libsodium23 libpgm-5.3-0 libnorm1 libbsd0 libmd0
  libgssapi-krb5-2 libkrb5-3 libk5crypto3 libkrb5support0 libcom-err2 libkeyutils1
  libcereal-dev catch2 nlohmann-json3-dev libtomlplusplus-dev libtomlplusplus3 libcli11-dev
  libspdlog-dev libspdlog1.10 libfmt-dev libfmt9
  libsqlite3-dev libsqlite3-0
  zlib1g-dev zlib1g
)
cd "$DEST"
missing=()
for p in "${PACKAGES[@]}"; do
  ls "${p}"_*.deb >/dev/null 2>&1 || missing+=("$p")
done
if ((${#missing[@]})); then
  apt-get download "${missing[@]}" 2>&1 | grep -v "^Get:" || true
fi
du -sh "$DEST"
