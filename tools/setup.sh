#!/usr/bin/env bash
# Installs what lorastream needs on Debian 12 (idempotent: a quick dpkg check when all is
# there) and builds the project into build/ (or $LORASTREAM_BUILD_DIR).
# Usage: tools/setup.sh [--no-build]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="${LORASTREAM_BUILD_DIR:-$ROOT/build}"

PACKAGES=(
  build-essential cmake ninja-build ccache pkg-config git
  libtorch-dev libopenblas0
  libboost-dev libzmq3-dev cppzmq-dev libcereal-dev catch2 nlohmann-json3-dev
  libtomlplusplus-dev libcli11-dev libspdlog-dev libsqlite3-dev
  clang libclang-rt-14-dev procps
  nodejs  # lorastream prepare (tools/prepare/prepare.mjs)
)

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  SUDO=""; [[ $(id -u) -ne 0 ]] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

[[ "${1:-}" == "--no-build" ]] && exit 0

JOBS="${LORASTREAM_JOBS:-$(nproc)}"
if [[ ! -f "$BUILD_DIR/build.ninja" ]]; then
  cmake -S "$ROOT" -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo
fi
cmake --build "$BUILD_DIR" -j"$JOBS"
