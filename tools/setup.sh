#!/usr/bin/env bash
# Picks the LibTorch to build against, brings the other dependencies, configures and builds
# lorastream into build/ (or $LORASTREAM_BUILD_DIR). The one set-up path: tools/run.sh,
# tools/test.sh and tools/gpu/build_and_test.sh all come through here.
#
# LibTorch, first that applies:
#   1. LORASTREAM_LIBTORCH=DIR: that folder (the official C++ zip's libtorch/, or a torch
#      wheel's torch/ folder).
#   2. a machine with an NVIDIA GPU, a CUDA compiler (nvcc on PATH or /usr/local/cuda/bin) and
#      python3 whose torch is a CUDA build: that torch's LibTorch (a CUDA build of lorastream).
#   3. Debian's CPU-only libtorch-dev.
# Other dependencies: installed with apt-get where that works (root or sudo, archive
# reachable); else the .deb folder of tools/gpu/gather_debs.sh ($LORASTREAM_DEBS, default
# .debs/) unpacked into .deps/ (never into /), which CMake and the binaries' RPATH point at.
# A build folder configured for another LibTorch is configured afresh.
#
# Usage: tools/setup.sh [--no-build]
#   LORASTREAM_BUILD_DIR   build folder (default: build/)
#   LORASTREAM_BUILD_TYPE  CMake build type (default: RelWithDebInfo)
#   LORASTREAM_JOBS        parallel build jobs (default: every core)
#   LORASTREAM_TARGETS     build only these targets (space-separated; default: all)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="${LORASTREAM_BUILD_DIR:-$ROOT/build}"
DEBS="${LORASTREAM_DEBS:-$ROOT/.debs}"
DEPS="$ROOT/.deps"
CUDA_TORCH_HINT="pip install torch --index-url https://download.pytorch.org/whl/cu130"

# --- which LibTorch ---------------------------------------------------------------------
have_gpu() {
  local dir="${LORASTREAM_NVIDIA_GPUS_DIR:-/proc/driver/nvidia/gpus}"
  if [[ -z "${LORASTREAM_NVIDIA_GPUS_DIR:-}" ]] && command -v nvidia-smi >/dev/null &&
     nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
    return 0
  fi
  [[ -d "$dir" && -n "$(ls -A "$dir" 2>/dev/null)" ]]
}
find_nvcc() {
  if command -v nvcc >/dev/null; then command -v nvcc
  elif [[ -x /usr/local/cuda/bin/nvcc ]]; then echo /usr/local/cuda/bin/nvcc
  fi
}
# "VERSION CUDA PREFIX" of python3's torch ("" when python3 has none); CUDA is "-" for CPU.
python_torch() {
  command -v python3 >/dev/null || return 0
  python3 - 2>/dev/null <<'EOF' || true
import torch, torch.utils
print(torch.__version__, torch.version.cuda or "-", torch.utils.cmake_prefix_path)
EOF
}
# Version and CUDA of a LibTorch folder (zip: build-version; wheel: version.py).
libtorch_dir_info() {
  local dir="$1" version="" cuda="-"
  if [[ -f "$dir/build-version" ]]; then version=$(head -1 "$dir/build-version")
  elif [[ -f "$dir/version.py" ]]; then
    version=$(sed -n "s/^__version__ *= *['\"]\([^'\"]*\)['\"].*/\1/p" "$dir/version.py")
    cuda=$(sed -n "s/^cuda *: *.*= *['\"]\([^'\"]*\)['\"].*/\1/p; s/^cuda *= *['\"]\([^'\"]*\)['\"].*/\1/p" "$dir/version.py" | head -1)
    [[ -z "$cuda" ]] && cuda="-"
  fi
  if [[ "$cuda" == "-" ]] && ls "$dir"/lib/libc10_cuda.so >/dev/null 2>&1; then
    cuda=$(sed -n 's/.*+cu\([0-9]*\)\([0-9]\)$/\1.\2/p' <<<"$version"); [[ -z "$cuda" ]] && cuda="yes"
  fi
  echo "${version:-unknown} $cuda"
}

TORCH_KIND=debian TORCH_PREFIX="" TORCH_VERSION="" TORCH_CUDA="-" WHY=""
NVCC="$(find_nvcc)"
if [[ -n "${LORASTREAM_LIBTORCH:-}" ]]; then
  dir="$(cd "$LORASTREAM_LIBTORCH" 2>/dev/null && pwd)" ||
    { echo "setup: LORASTREAM_LIBTORCH=$LORASTREAM_LIBTORCH is not a folder" >&2; exit 2; }
  [[ -f "$dir/share/cmake/Torch/TorchConfig.cmake" ]] ||
    { echo "setup: LORASTREAM_LIBTORCH=$dir holds no share/cmake/Torch/TorchConfig.cmake" \
           "(name the libtorch/ folder of the C++ zip, or a torch wheel's torch/ folder)" >&2; exit 2; }
  read -r TORCH_VERSION TORCH_CUDA <<<"$(libtorch_dir_info "$dir")"
  TORCH_KIND=explicit TORCH_PREFIX="$dir" WHY="chosen by LORASTREAM_LIBTORCH"
else
  if ! have_gpu; then
    WHY="no NVIDIA GPU on this machine"
  elif [[ -z "$NVCC" ]]; then
    WHY="an NVIDIA GPU but no CUDA compiler (nvcc): install the CUDA toolkit into /usr/local/cuda"
  else
    read -r pv pc pp <<<"$(python_torch)"
    if [[ -z "${pv:-}" ]]; then
      WHY="GPU and nvcc found but python3 has no torch; get a CUDA one: $CUDA_TORCH_HINT"
    elif [[ "$pc" == "-" ]]; then
      WHY="GPU and nvcc found but python3's torch $pv is CPU-only; get a CUDA one: $CUDA_TORCH_HINT"
    else
      TORCH_KIND=python TORCH_PREFIX="$pp" TORCH_VERSION="$pv" TORCH_CUDA="$pc"
      WHY="GPU and nvcc found"
    fi
  fi
fi

# --- the other dependencies ---------------------------------------------------------------
# Tools are looked for as commands (a GPU machine may have them from elsewhere), libraries as
# Debian packages.
# node runs `lorastream prepare`'s tools/prepare/prepare.mjs.
TOOLS=(g++:build-essential cmake:cmake ninja:ninja-build node:nodejs)
PACKAGES=(
  ccache pkg-config git procps
  libboost-dev libzmq3-dev cppzmq-dev libcereal-dev catch2 nlohmann-json3-dev
  libtomlplusplus-dev libcli11-dev libspdlog-dev libsqlite3-dev zlib1g-dev
)
# Debian's LibTorch (and the BLAS it needs) only when it is the one chosen; clang and its
# sanitizer runtime for tools/test.sh's fuzzers, clang-format for its format check.
[[ "$TORCH_KIND" == debian ]] &&
  PACKAGES+=(libtorch-dev libopenblas0 clang libclang-rt-14-dev clang-format)

missing=()
for t in "${TOOLS[@]}"; do command -v "${t%%:*}" >/dev/null || missing+=("${t#*:}"); done
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
deps_stamp() { ls "$DEBS"/*.deb 2>/dev/null | sort | md5sum | cut -d' ' -f1; }
unpack_deps() {  # dpkg -x never runs maintainer scripts and never touches /
  rm -rf "$DEPS"; mkdir -p "$DEPS"
  for f in "$DEBS"/*.deb; do dpkg -x "$f" "$DEPS"; done
  deps_stamp > "$DEPS/.stamp"
}
try_apt() {
  local sudo=""
  if [[ $(id -u) -ne 0 ]]; then command -v sudo >/dev/null || return 1; sudo="sudo -n"; fi
  command -v apt-get >/dev/null || return 1
  echo "setup: installing ${missing[*]}"
  timeout 300 $sudo apt-get update -qq &&
    DEBIAN_FRONTEND=noninteractive timeout 1800 $sudo apt-get install -y -qq \
      --no-install-recommends "${missing[@]}"
}
USE_DEPS=0
if ((${#missing[@]})); then
  HAVE_DEBS=0; compgen -G "$DEBS/*.deb" >/dev/null && HAVE_DEBS=1
  if ((HAVE_DEBS)) && [[ "$(cat "$DEPS/.stamp" 2>/dev/null)" == "$(deps_stamp)" ]]; then
    USE_DEPS=1  # unpacked before: apt was not usable then
  elif try_apt; then
    :
  elif ((HAVE_DEBS)); then
    echo "setup: apt-get cannot install here; using the .deb files in $DEBS (unpacked into $DEPS)"
    unpack_deps
    USE_DEPS=1
  else
    echo "setup: missing ${missing[*]}; apt-get cannot install them here (not root, or no" \
         "archive) and there is no .deb folder at $DEBS: gather one on a Debian 12 machine" \
         "with tools/gpu/gather_debs.sh and bring it along (or set LORASTREAM_DEBS)" >&2
    exit 1
  fi
fi

# Optional, for two tests, and only where apt-get works (elsewhere those tests are not
# registered): Debian's Slurm (a real slurmctld and two slurmd on this machine run the `slurm`
# test) and python3-yaml (the Kubernetes example's syntax check).
missing=()
for p in slurmctld slurmd slurm-client python3-yaml; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})) && ! ((USE_DEPS)); then
  try_apt || echo "setup: ${missing[*]} not installed: the slurm and Kubernetes example tests" \
    "are left out"
fi

# --- the one line ---------------------------------------------------------------------------
case "$TORCH_KIND" in
  debian)
    # The version LibTorch's own CMake files (and headers) state; the package's may differ.
    TORCH_VERSION=$(sed -n 's/^set(PACKAGE_VERSION "\(.*\)")/\1/p' \
      /usr/lib/*/cmake/Torch/TorchConfigVersion.cmake 2>/dev/null | head -1)
    pkg=$(dpkg-query -W -f='${Version}' libtorch-dev 2>/dev/null || true)
    echo "setup: LibTorch ${TORCH_VERSION:-?} (CPU) from Debian's libtorch-dev ${pkg}: $WHY" ;;
  python)
    echo "setup: LibTorch $TORCH_VERSION (CUDA $TORCH_CUDA) from python3's torch ($TORCH_PREFIX): $WHY" ;;
  explicit)
    [[ "$TORCH_CUDA" == "-" ]] && kind="CPU" || kind="CUDA $TORCH_CUDA"
    echo "setup: LibTorch $TORCH_VERSION ($kind) from $TORCH_PREFIX: $WHY" ;;
esac
[[ "${1:-}" == "--no-build" ]] && exit 0

# --- configure (afresh when the choice changed) and build -----------------------------------
WANT_CUDA=0
[[ "$TORCH_CUDA" != "-" && -n "$NVCC" ]] && WANT_CUDA=1
CMAKE_ARGS=(-G Ninja -DCMAKE_BUILD_TYPE="${LORASTREAM_BUILD_TYPE:-RelWithDebInfo}")
PREFIX_PATH="$TORCH_PREFIX"
LINK_FLAGS=""
RPATH=""
if ((USE_DEPS)); then
  DEPS_LIB="$DEPS/usr/lib/x86_64-linux-gnu"
  PREFIX_PATH="${PREFIX_PATH:+$PREFIX_PATH;}$DEPS/usr"
  # DT_RPATH (not RUNPATH) also serves the libraries' own dependencies (libzmq -> libsodium).
  LINK_FLAGS="-Wl,--disable-new-dtags -Wl,-rpath-link,$DEPS_LIB"
  RPATH="$DEPS_LIB"
fi
if ((WANT_CUDA)); then
  CUDA_CC=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' ')
  [[ "$CUDA_CC" =~ ^[0-9]+\.[0-9]+$ ]] || CUDA_CC=9.0
  CUDA_ROOT="$(dirname "$(dirname "$NVCC")")"
  CMAKE_ARGS+=(-DCMAKE_CUDA_COMPILER="$NVCC" -DCUDAToolkit_ROOT="$CUDA_ROOT"
               -DCMAKE_CUDA_ARCHITECTURES="${CUDA_CC/./}" -DTORCH_CUDA_ARCH_LIST="$CUDA_CC")
  export PATH="$CUDA_ROOT/bin:$PATH"
fi
[[ -n "$PREFIX_PATH" ]] && CMAKE_ARGS+=(-DCMAKE_PREFIX_PATH="$PREFIX_PATH")
if [[ -n "$LINK_FLAGS" ]]; then
  CMAKE_ARGS+=(-DCMAKE_EXE_LINKER_FLAGS="$LINK_FLAGS" -DCMAKE_SHARED_LINKER_FLAGS="$LINK_FLAGS"
               -DCMAKE_BUILD_RPATH="$RPATH" -DCMAKE_INSTALL_RPATH="$RPATH")
fi
CHOICE="$TORCH_KIND|$TORCH_PREFIX|$TORCH_VERSION|$WANT_CUDA|$USE_DEPS|${CMAKE_ARGS[*]}"
if [[ ! -f "$BUILD_DIR/build.ninja" || "$(cat "$BUILD_DIR/.lorastream-setup" 2>/dev/null)" != "$CHOICE" ]]; then
  # Another LibTorch than last time: nothing of the old cache (Torch_DIR, CUDA) may survive.
  rm -rf "$BUILD_DIR/CMakeCache.txt" "$BUILD_DIR/CMakeFiles"
  cmake -S "$ROOT" -B "$BUILD_DIR" "${CMAKE_ARGS[@]}"
  echo "$CHOICE" > "$BUILD_DIR/.lorastream-setup"
fi
if ((WANT_CUDA)) && ! grep -q "LORASTREAM_BUILD_CUDA 1" "$BUILD_DIR/generated/lorastream_build_config.h"; then
  echo "setup: configured against a CUDA LibTorch but CMake did not enable the CUDA backend;" \
       "see $BUILD_DIR/CMakeFiles/CMakeOutput.log" >&2
  rm -f "$BUILD_DIR/.lorastream-setup"
  exit 1
fi
JOBS="${LORASTREAM_JOBS:-$(nproc)}"
cmake --build "$BUILD_DIR" -j"$JOBS" ${LORASTREAM_TARGETS:+--target $LORASTREAM_TARGETS}
