#!/usr/bin/env bash
# Build the MicroPython Unix port with the board firmware FROZEN in: the
# device core, firmware/ and umqtt.simple compiled into the image as
# `make FROZEN_MANIFEST=firmware/manifest.py` does for an ESP32 or a Pico W
# (tests/mpunix/manifest.py: that manifest plus micropython-lib's ssl
# wrapper, which the official board images freeze too). Code then runs from
# the image, not from the heap, as on a board flashed with deploy/flash.sh
# --frozen.
#
#   tests/mpunix/build-frozen.sh      # prints the binary's path on its last line
#
# Same VM options as tests/mpunix/build.sh (32-bit where gcc -m32 works, the
# `tls` module on the bundled Mbed TLS allocating from the Python heap, no
# btree/ffi), plus the C module tests/mpunix/cmod/tlsalloc:
# `tlsalloc.outside()` moves Mbed TLS's allocations to libc (outside
# -X heapsize), as on an ESP32, where Mbed TLS lives in the ESP-IDF heap.
#
# The image holds this checkout's agent/ and firmware/, so it is built per
# checkout into .micropython-frozen/ (gitignored; PANSKETCH_MPUNIX_FROZEN_DIR
# overrides), never into .micropython/ (build.sh's unfrozen VM, which other
# checkouts may share by symlink). Each call re-runs make: the first build
# takes about as long as build.sh's (2 cores: 1-3 min); afterwards only a
# changed source is re-frozen and the binary relinked (seconds).
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
shared=${PANSKETCH_SHARED:-$repo/../shared}
cache=${PANSKETCH_MPUNIX_FROZEN_DIR:-$repo/.micropython-frozen}
if ! ls "$shared"/micropython/micropython-*.tar.gz >/dev/null 2>&1; then
  echo "tests/mpunix/build-frozen.sh: no MicroPython tarball in $shared/micropython (set PANSKETCH_SHARED to the shared directory holding micropython/)" >&2
  exit 3
fi
mkdir -p "$cache"
exec 9>"$cache.lock"   # two test runs in one checkout build once
flock 9 2>/dev/null || true

. "$repo/tests/mpunix/vmbits.sh" "tests/mpunix/build-frozen.sh"
tarball=$(ls "$shared"/micropython/micropython-*.tar.gz | head -n 1)
if [ "$bits" = 32 ]; then
  build=build-frozen32
  flags="-m32 -DMICROPY_MBEDTLS_CONFIG_BARE_METAL=1 -DMICROPY_TRACKED_ALLOC=1"
  ldflags=-m32
else
  # libc's allocator does not track blocks for MicroPython: Mbed TLS stays on libc (tlsalloc.outside is a no-op)
  build=build-frozen
  flags=""
  ldflags=""
fi
sum="$(sha256sum "$tarball" | cut -d' ' -f1) $bits-bit frozen"
src="$cache/micropython"
if [ "$(cat "$cache/SOURCE" 2>/dev/null)" != "$sum" ]; then
  rm -rf "$src" "$cache/SOURCE"
  tar -xzf "$tarball" -C "$cache"
fi
unix="$src/ports/unix"
bin="$unix/$build/micropython"
# GIT_CEILING_DIRECTORIES: MicroPython's version header must not take this repository's commit
export GIT_CEILING_DIRECTORIES="$cache"
# mpy-cross for the host first (compiles the frozen modules; bytecode is the same for every word size)
make -s -C "$src/mpy-cross" -j"$(nproc)" >&2
cmod="$repo/tests/mpunix/cmod"
if [ "$bits" = 64 ]; then cmod=""; fi
make -s -C "$unix" -j"$(nproc)" BUILD="$build" CFLAGS_EXTRA="$flags" LDFLAGS_EXTRA="$ldflags" \
  MICROPY_PY_BTREE=0 MICROPY_PY_SSL=1 MICROPY_PY_FFI=0 \
  FROZEN_MANIFEST="$repo/tests/mpunix/manifest.py" USER_C_MODULES="$cmod" >&2
"$bin" -c "import sys, tls; assert sys.implementation.name == 'micropython'; assert sys.maxsize == (2**31 - 1 if $bits == 32 else 2**63 - 1)"
"$bin" -c "import sys; sys.path[:] = ['.frozen']; from pansketch.firmware import app; from umqtt import simple; import ssl"
echo "$sum" > "$cache/SOURCE"
echo "$bin"
