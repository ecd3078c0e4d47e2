#!/usr/bin/env bash
# Build (once) the MicroPython Unix port that tests/support/unixvm.py runs the board
# firmware on: a real VM with real sockets, os.urandom, a fixed heap
# (-X heapsize=) and the real garbage collector. Sources and micropython-lib
# (umqtt.simple) come from the tarball bundled in ../shared/micropython
# (relative to the repository root; PANSKETCH_SHARED overrides ../shared).
#
#   tests/mpunix/build.sh            # prints the binary's path on its last line
#
# 32-bit when the C compiler can build for it (gcc -m32; Debian: gcc-multilib,
# which .ci/run installs on x86-64): boards (ESP32, RP2040) are 32-bit, and a
# 64-bit VM needs about 1.5x their heap for the same objects. Otherwise, or
# with PANSKETCH_MPUNIX_BITS=64, the 64-bit build of
# ../shared/micropython/build-unix.sh. Same options either way: the `tls`
# module on the bundled Mbed TLS (the firmware connects over TLS;
# PANSKETCH_MP_TLS=0 leaves it out), no btree, ffi or frozen modules.
# The 32-bit build also makes Mbed TLS allocate from the Python heap
# (MICROPY_MBEDTLS_CONFIG_BARE_METAL, as MicroPython's coverage build does;
# entropy from the port's mp_hal_get_random, i.e. the kernel), which is how
# the Pico W's port does it: TLS's record buffers and handshake state count
# against -X heapsize, the tight case for a board (on an ESP32 they live
# in the IDF heap). The 64-bit fallback allocates them with libc.
#
# The build goes to .micropython/ in the repository (gitignored). It is skipped
# when the binary exists, runs, and was built from the same tarball and word
# size (.micropython/SOURCE); otherwise the cache is rebuilt from scratch.
# Needs gcc, make, pkg-config (Debian: build-essential pkg-config).
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
shared=${PANSKETCH_SHARED:-$repo/../shared}
builder="$shared/micropython/build-unix.sh"
cache="$repo/.micropython"
if [ ! -f "$builder" ]; then
  echo "tests/mpunix/build.sh: $builder not found: the MicroPython sources are not in this repository (set PANSKETCH_SHARED to the shared directory holding micropython/, or PANSKETCH_MICROPYTHON to a Unix-port binary; README, make test)" >&2
  exit 3
fi
exec 9>"$repo/.micropython.lock"   # two test runs in one checkout build once
flock 9 2>/dev/null || true

. "$repo/tests/mpunix/vmbits.sh" "tests/mpunix/build.sh"
unix="$cache/micropython/ports/unix"
if [ "$bits" = 32 ]; then bin="$unix/build-standard32/micropython"; else bin="$unix/build-standard/micropython"; fi

tarball=$(ls "$shared"/micropython/micropython-*.tar.gz | head -n 1)
tls=${PANSKETCH_MP_TLS:-1}
tlsheap=
if [ "$tls" != 0 ] && [ "$bits" = 32 ]; then
  tlsheap="-DMICROPY_MBEDTLS_CONFIG_BARE_METAL=1 -DMICROPY_TRACKED_ALLOC=1"
fi
sum="$(sha256sum "$tarball" | cut -d' ' -f1) $bits-bit tls=$tls${tlsheap:+ tls-in-heap}"
if [ -x "$bin" ] && [ "$(cat "$cache/SOURCE" 2>/dev/null)" = "$sum" ] \
   && "$bin" -c "import sys; assert sys.implementation.name == 'micropython'" 2>/dev/null; then
  echo "$bin"
  exit 0
fi
rm -rf "$cache"
mkdir -p "$cache"
# GIT_CEILING_DIRECTORIES: MicroPython's version header must not take this
# repository's commit (git describe would find it above the cache).
export GIT_CEILING_DIRECTORIES="$cache"
if [ "$bits" = 32 ]; then
  tar -xzf "$tarball" -C "$cache"
  # build-unix.sh's options, for a 32-bit target
  make -s -C "$unix" -j"$(nproc)" BUILD=build-standard32 CFLAGS_EXTRA="-m32 $tlsheap" LDFLAGS_EXTRA=-m32 \
    MICROPY_PY_BTREE=0 MICROPY_PY_SSL="$tls" MICROPY_PY_FFI=0 FROZEN_MANIFEST= >&2
  "$bin" -c "import sys; assert sys.implementation.name == 'micropython' and sys.maxsize == 2**31 - 1"
else
  out=$(PANSKETCH_MP_TLS=$tls "$builder" "$cache" | tail -n 1)
  [ "$out" = "$bin" ] || { echo "tests/mpunix/build.sh: unexpected binary path $out" >&2; exit 1; }
fi
if [ "$tls" != 0 ]; then
  "$bin" -c "import tls" || { echo "tests/mpunix/build.sh: the build has no tls module" >&2; exit 1; }
fi
echo "$sum" > "$cache/SOURCE"
echo "$bin"
