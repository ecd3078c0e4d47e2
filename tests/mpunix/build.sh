#!/usr/bin/env bash
# Build (once) the MicroPython Unix port that tests/unixvm.py runs the board
# firmware on: a real VM with real sockets, os.urandom, a fixed heap
# (-X heapsize=) and the real garbage collector. Sources and micropython-lib
# (umqtt.simple) come from the tarball bundled in ../shared/micropython
# (relative to the repository root; PANSKETCH_SHARED overrides ../shared).
#
#   tests/mpunix/build.sh            # prints the binary's path on its last line
#
# The build goes to .micropython/ in the repository (gitignored). It is skipped
# when the binary exists, runs, and was built from the same tarball (its
# SHA-256 is kept in .micropython/SOURCE); otherwise the cache is rebuilt from
# scratch. Needs gcc, make, pkg-config (Debian: build-essential pkg-config).
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
shared=${PANSKETCH_SHARED:-$repo/../shared}
builder="$shared/micropython/build-unix.sh"
cache="$repo/.micropython"
bin="$cache/micropython/ports/unix/build-standard/micropython"
if [ ! -f "$builder" ]; then
  echo "tests/mpunix/build.sh: $builder not found (set PANSKETCH_SHARED to the shared directory)" >&2
  exit 3
fi
exec 9>"$repo/.micropython.lock"   # two test runs in one checkout build once
flock 9 2>/dev/null || true
tarball=$(ls "$shared"/micropython/micropython-*.tar.gz | head -n 1)
sum=$(sha256sum "$tarball" | cut -d' ' -f1)
if [ -x "$bin" ] && [ "$(cat "$cache/SOURCE" 2>/dev/null)" = "$sum" ] \
   && "$bin" -c "import sys; assert sys.implementation.name == 'micropython'" 2>/dev/null; then
  echo "$bin"
  exit 0
fi
rm -rf "$cache"
mkdir -p "$cache"
# GIT_CEILING_DIRECTORIES: MicroPython's version header must not take this
# repository's commit (git describe would find it above the cache).
out=$(GIT_CEILING_DIRECTORIES="$cache" "$builder" "$cache" | tail -n 1)
[ "$out" = "$bin" ] || { echo "tests/mpunix/build.sh: unexpected binary path $out" >&2; exit 1; }
echo "$sum" > "$cache/SOURCE"
echo "$bin"
