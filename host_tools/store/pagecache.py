"""Let the kernel forget the database file's pages once they are on disk.

The aggregator writes each release once (the checkpoint copies it from the
WAL into the database file) and reads it back only when a query asks. Left
alone, the kernel keeps every page written in its page cache, so the cache
grows with the file: about 5 MB/s at 700 releases/s. That growth is not
free on a virtual machine whose memory the host hands out on first touch
(Firecracker and other micro-VMs, with free page reporting returning freed
memory to the host): each page of new cache costs a host fault. Measured on
the 2-core test VM, writing 4 KiB pages cost 3.6 µs each into memory the
guest had touched before and 13.7 µs into memory it had not; the
aggregator's checkpoint thread stepped from 4–6 to 11–19 µs per release
once its cache outgrew the touched memory (docs/PERFORMANCE-HISTORY.md).

:class:`WrittenTail` advises ``POSIX_FADV_DONTNEED`` for everything more
than ``behind`` bytes before the file's end, after a checkpoint that copied
the whole WAL (SQLite then has synced the file, so those pages are clean and
the kernel drops them). The freed pages are the ones the next writes reuse.
Nothing is lost: a query reads dropped pages from disk again. Pages that were
still dirty are skipped by the kernel; the next call covers the last
``behind`` bytes it already advised once more, so they get a second chance.
On tmpfs, whose page cache is the data, the kernel ignores the advice.
"""

from __future__ import annotations

import os

ALIGN = 1 << 20  # advise whole MiB: the file's tail moves in pages, the advice need not follow each one


def supported() -> bool:
    return hasattr(os, "posix_fadvise") and hasattr(os, "POSIX_FADV_DONTNEED")


class WrittenTail:
    """Drop the page cache of ``path`` except its last ``behind`` bytes (see the module docstring)."""

    def __init__(self, path: str, behind: int) -> None:
        if behind <= 0:
            raise ValueError("behind must be positive")
        self.behind = behind
        self.done = 0  # advised up to here
        self._fd = os.open(path, os.O_RDONLY)

    def forget(self) -> int:
        """Advise DONTNEED up to ``behind`` before the end; the bytes advised (0 when the end has not moved on)."""
        upto = (os.fstat(self._fd).st_size - self.behind) // ALIGN * ALIGN
        if upto <= self.done:
            return 0
        lo = max(0, self.done - self.behind)
        os.posix_fadvise(self._fd, lo, upto - lo, os.POSIX_FADV_DONTNEED)
        self.done = upto
        return upto - lo

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
