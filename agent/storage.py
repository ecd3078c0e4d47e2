"""Crash-safe files on a Pi's disk or a board's flash: outbox, state, marker.

Layout of a state directory::

    outbox/<seq:010d>.cbor   releases waiting for the host's ack (final bytes)
    outbox/rejected/<seq>.cbor  releases the host refused (kept, never re-sent)
    outbox/<seq:010d>.tmp    a release being committed (see Recorder.release)
    state.bin                the noisy sketch state (only ever noisy)
    released                 "<seq> <elo> <ehi> <part>" of the last release

Every file is written to ``<name>.new`` and renamed over the old one, so a
power cut leaves either the old or the new version. On filesystems whose
rename refuses to replace (FAT), the old file is removed first and a
leftover ``.new`` is recovered at load time.
"""

import hashlib
import os
import struct

try:
    _fsync = os.fsync
except AttributeError:  # MicroPython: flush+close is what we have
    _fsync = None  # type: ignore[assignment]  # MicroPython: no os.fsync


def join(a, b):
    return a + "/" + b


def exists(path):
    try:
        os.stat(path)
        return True
    except OSError:
        return False


def makedirs(path):
    cur = ""
    for part in path.split("/"):
        if not part:
            cur = "/" if not cur else cur
            continue
        cur = part if cur == "" else (cur + part if cur.endswith("/") else cur + "/" + part)
        if not exists(cur):
            os.mkdir(cur)


def remove(path):
    try:
        os.remove(path)
    except OSError:
        pass


def write_atomic(path, chunks):
    """Write an iterable of byte chunks (or a function taking ``write``) atomically."""
    tmp = path + ".new"
    f = open(tmp, "wb")
    try:
        if callable(chunks):
            chunks(f.write)
        else:
            for c in chunks:
                f.write(c)
        f.flush()
        if _fsync is not None:
            _fsync(f.fileno())
    except BaseException:
        f.close()
        remove(tmp)
        raise
    f.close()
    rename(tmp, path)


def rename(src, dst):
    try:
        os.rename(src, dst)
    except OSError:
        # FAT-style filesystems refuse to rename over an existing file.
        remove(dst)
        os.rename(src, dst)


def read(path):
    f = open(path, "rb")
    try:
        return f.read()
    finally:
        f.close()


def recover(path, check=None):
    """Finish an interrupted write_atomic: keep ``path`` or adopt ``path.new``.

    ``path.new`` is adopted only if ``check(path.new)`` says it is complete
    (a power cut can leave a half-written one); otherwise it is removed.
    """
    if not exists(path) and exists(path + ".new"):
        if check is None or check(path + ".new"):
            os.rename(path + ".new", path)
        else:
            remove(path + ".new")


class Outbox:
    """Releases on flash, oldest first, each kept byte-for-byte until the host acks it.

    ``limit`` (0: none, flash is the bound) caps the releases it holds: when
    full, the Recorder keeps counting and releases a longer epoch range once
    the host has caught up (agent/recorder.py), so a host that is down for
    longer than the outbox holds costs accuracy, never a release.
    """

    def __init__(self, root, limit=0):
        self.dir = join(root, "outbox")
        self.limit = limit
        makedirs(self.dir)

    def path(self, seq, ext=".cbor"):
        return join(self.dir, "%010d%s" % (seq, ext))

    def _seqs(self, ext):
        out = []
        for name in os.listdir(self.dir):
            if name.endswith(ext) and len(name) == 10 + len(ext):
                out.append(int(name[:10]))
        out.sort()
        return out

    def pending(self):
        """Sequence numbers ready to publish, in order."""
        return self._seqs(".cbor")

    def uncommitted(self):
        return self._seqs(".tmp")

    def finish(self, upto):
        """Rename the .tmp of releases below ``upto`` (their marker was written) to .cbor."""
        for s in self._seqs(".tmp"):
            if s < upto:
                rename(self.path(s, ".tmp"), self.path(s))

    def read(self, seq):
        return read(self.path(seq))

    def has(self, seq):
        return exists(self.path(seq))

    def full(self):
        return self.limit > 0 and len(self.pending()) >= self.limit

    def ack(self, seq):
        """The host has stored the release: forget it."""
        remove(self.path(seq))

    def reject(self, seq):
        """The host will never store it: set it aside in ``rejected/`` (kept for the operator)."""
        d = join(self.dir, "rejected")
        makedirs(d)
        rename(self.path(seq), join(d, "%010d.cbor" % seq))

    def rejected(self):
        """Number of releases the host refused."""
        d = join(self.dir, "rejected")
        if not exists(d):
            return 0
        return len([n for n in os.listdir(d) if n.endswith(".cbor")])


STATE_MAGIC = b"PSKS"
STATE_VERSION = 1
# magic, version, pad, fingerprint(8), seq, elo, ehi, part, noise draws, ncells
_HDR = "<4sB3x8sIqqIII"
_HDR_LEN = struct.calcsize(_HDR)


class StateError(Exception):
    pass


def write_state(path, fingerprint, seq, elo, ehi, part, nz, counters):
    """Persist the (noisy) state: header, raw int32 counters, SHA-256 trailer.

    ``nz`` is the number of independent noise draws per cell in ``counters``.
    """
    hdr = struct.pack(_HDR, STATE_MAGIC, STATE_VERSION, fingerprint, seq, elo, ehi, part, nz, len(counters))
    h = hashlib.sha256(hdr)
    h.update(counters)

    def body(write):
        write(hdr)
        write(counters)
        write(h.digest())

    write_atomic(path, body)


def read_state(path, fingerprint, counters, alt=None):
    """Load a state file into ``counters``; returns (seq, elo, ehi, part, nz) or None.

    The counters are read straight into the preallocated array (no copy of
    the file in RAM: on a board that copy would set the boot-time heap peak).
    Raises StateError if the file is corrupt or was made with other params.
    With ``alt`` (a second accepted fingerprint) the tuple has a sixth
    element, True when the file carries ``alt``.
    """
    recover(path, _state_complete)
    if not exists(path):
        return None
    f = open(path, "rb")
    try:
        hdr = f.read(_HDR_LEN)
        if len(hdr) != _HDR_LEN:
            raise StateError("state file %s is truncated" % path)
        magic, ver, fp, seq, elo, ehi, part, nz, n = struct.unpack(_HDR, hdr)
        if magic != STATE_MAGIC or ver != STATE_VERSION:
            raise StateError("state file %s has an unknown format" % path)
        if (fp != fingerprint and (alt is None or fp != alt)) or n != len(counters):
            raise StateError(
                "state file %s was written with different parameters; "
                "restore the old config or move the directory away" % path
            )
        got = f.readinto(counters)
        trailer = f.read(32)
        if got != 4 * n or len(trailer) != 32 or f.read(1):
            raise StateError("state file %s is truncated" % path)
    finally:
        f.close()
    h = hashlib.sha256(hdr)
    h.update(counters)
    if h.digest() != trailer:
        raise StateError("state file %s fails its checksum" % path)
    if alt is not None:
        return (seq, elo, ehi, part, nz, fp != fingerprint)
    return (seq, elo, ehi, part, nz)


def complete(path, hdr_len, magic, body_len):
    """True if a file is whole: header with ``magic``, then ``body_len(hdr)``
    bytes, then the SHA-256 of everything before it, and nothing after.

    For state files (this module's and agent/tree.py's): a power cut can
    leave a half-written ``.new``, which must not be adopted.
    """
    f = open(path, "rb")
    try:
        hdr = f.read(hdr_len)
        if len(hdr) != hdr_len or hdr[:4] != magic:
            return False
        h = hashlib.sha256(hdr)
        left = body_len(hdr)
        while left > 0:
            chunk = f.read(min(left, 512))
            if not chunk:
                return False
            h.update(chunk)
            left -= len(chunk)
        return f.read(32) == h.digest() and not f.read(1)
    finally:
        f.close()


def _state_complete(path):
    """True if a state file is whole: its length and SHA-256 trailer match."""
    return complete(path, _HDR_LEN, STATE_MAGIC, lambda hdr: 4 * struct.unpack(_HDR, hdr)[-1])


def _marker_complete(path):
    parts = read(path).split()
    if not parts or len(parts) % 4:
        return False
    for p in parts:
        if not p.isdigit():
            return False
    return True


def write_marker(path, seq, elo, ehi, part):
    write_atomic(path, [("%d %d %d %d\n" % (seq, elo, ehi, part)).encode()])


def read_marker(path):
    """(seq, elo, ehi, part) of the last committed release, or None."""
    lines = read_markers(path)
    return lines[-1] if lines else None


def write_markers(path, lines):
    """Tree mode: the keys released since the last state write, one per line
    ("<seq> <elo> <ehi> <part>", oldest first); the last line is the last release."""
    out = []
    for ln in lines:
        out.append(("%d %d %d %d\n" % ln).encode())
    write_atomic(path, out)


def read_markers(path):
    """All (seq, elo, ehi, part) lines of the marker, oldest first ([] if none)."""
    recover(path, _marker_complete)
    if not exists(path):
        return []
    parts = read(path).decode().split()
    if not parts or len(parts) % 4:
        raise StateError("marker %s is corrupt" % path)
    out = []
    for i in range(0, len(parts), 4):
        out.append((int(parts[i]), int(parts[i + 1]), int(parts[i + 2]), int(parts[i + 3])))
    return out
