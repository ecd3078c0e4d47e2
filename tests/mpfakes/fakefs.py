"""Flash faults for pansketch.agent.storage: a size quota (full flash) and power cuts.

``install(root)`` makes pansketch.agent.storage use wrapped ``open`` and ``os``:

* ``quota[0] = N``: writes that would make the files under ``root`` exceed
  N bytes raise OSError(28) (ENOSPC), as a full LittleFS/FAT does;
* ``cut_on_rename[0] = (suffix, k)``: the k-th rename (1-based) whose
  destination ends with ``suffix`` raises fakehw.PowerCut *instead of*
  renaming -- the step dies there, and whatever is on flash stays.
"""
import builtins
import os as _os

import fakehw

quota = [None]
cut_on_rename = [None]
_root = ["/flash"]


def usage(path=None):
    path = path or _root[0]
    total = 0
    for name in _os.listdir(path):
        p = path + "/" + name
        st = _os.stat(p)
        if st[0] & 0x4000:
            total += usage(p)
        else:
            total += st[6]
    return total


class _File:
    def __init__(self, f):
        self.f = f

    def write(self, b):
        q = quota[0]
        if q is not None and usage() + len(b) > q:
            raise OSError(28)
        return self.f.write(b)

    def flush(self):
        return self.f.flush()

    def close(self):
        return self.f.close()

    def read(self, *a):
        return self.f.read(*a)

    def readinto(self, *a):
        return self.f.readinto(*a)


def _open(path, mode="r"):
    f = builtins.open(path, mode)
    if "w" in mode or "a" in mode:
        return _File(f)
    return f


class _Os:
    def stat(self, p):
        return _os.stat(p)

    def listdir(self, p):
        return _os.listdir(p)

    def mkdir(self, p):
        return _os.mkdir(p)

    def remove(self, p):
        return _os.remove(p)

    def rename(self, a, b):
        c = cut_on_rename[0]
        if c is not None and b.endswith(c[0]):
            k = c[1] - 1
            if k <= 0:
                cut_on_rename[0] = None
                raise fakehw.PowerCut("power cut before rename %s -> %s" % (a, b))
            cut_on_rename[0] = (c[0], k)
        return _os.rename(a, b)


def install(root="/flash"):
    import pansketch.agent.storage as S

    _root[0] = root
    S.open = _open
    S.os = _Os()
