# Sourced by build.sh and build-frozen.sh: sets $bits to 32 when the C compiler can build
# for it (gcc -m32; Debian: gcc-multilib), else 64 with a note on stderr naming the script
# ($1). PANSKETCH_MPUNIX_BITS overrides the probe.
bits=${PANSKETCH_MPUNIX_BITS:-}
if [ -z "$bits" ]; then
  probe=$(mktemp -d)
  if printf 'int main(void){return 0;}\n' > "$probe/t.c" && gcc -m32 -o "$probe/t" "$probe/t.c" >/dev/null 2>&1 \
     && "$probe/t"; then
    bits=32
  else
    bits=64
    echo "$1: no 32-bit toolchain (gcc -m32; Debian: gcc-multilib): building the 64-bit VM" >&2
  fi
  rm -rf "$probe"
fi
