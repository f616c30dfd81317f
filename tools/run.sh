#!/usr/bin/env bash
# The README's main-job command: installs what is missing, builds, then runs `lorastream up`
# (a store, one worker per GPU or two CPU workers, a coordinator, the example jobs, the live
# view). Arguments go to `lorastream up` (see `build/bin/lorastream up --help`). It builds
# only the executables `up` runs (not the test binaries: tools/test.sh builds those), unless
# LORASTREAM_TARGETS says otherwise.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="${LORASTREAM_BUILD_DIR:-$ROOT/build}"
LORASTREAM_TARGETS="${LORASTREAM_TARGETS:-lorastream lorastream-store lorastream-synth lorastream-worker}" \
  "$ROOT/tools/setup.sh"
exec "$BUILD_DIR/bin/lorastream" up "$@"
