"""Stored bytes per release: the payload encoding (pansketch.host_tools.store.payloadcodec) against the
counters' empirical entropy, the codecs it was chosen from, and what it costs the write path.

    python -m pansketch.host_tools.bench.storage [--windows 4] [--devices 64] [--rounds 3]
                                       [--out bench-results/storage.json] [--quick] [--no-candidates]

* releases made by the real device core (pansketch.agent.recorders, real
  discrete noise, a deterministic source) of every kind: cs d=4 w=2048 and
  cms d=4 w=256 with 30,000 Zipf events per hourly window, a cs tree
  (L=3, w=1024, 3,000 events per epoch), dcs b=16 d=4 w=1024 (skewed
  readings), strhh len=8 d=3 w=256, dbits d=12 w=512 (dlap eps=1);
* per kind: the wire size, the counters' order-0 entropy ``n * H`` in
  bytes (Miller-Madow, the ``windows`` releases pooled; the plug-in
  estimate of one release beside it), the stored size and the
  encode/decode CPU of every candidate: zlib (levels 1, 6, 9 and Z_RLE),
  lzma, bz2 and zstd (levels 1 and 3, the ``zstandard`` package) on the
  codec's byte planes (the call alone: the transform is the codec's,
  common to all), and on the raw int32 bytes for reference;
* the write path, A/B in this process: groups of 256 releases committed to
  a SQLite store with the payload encoded on the write path vs stored raw
  (the peer) vs encoded beforehand (SQLite's own part), rounds
  alternating, CPU (user + sys of this process: SQLite runs in it) per
  release, and the file's bytes per release after a checkpoint (the row's
  own cost included).

Figures to ``--out`` (JSON) and a Markdown table on stdout (docs/HOST.md
"Stored encoding" quotes it).
"""

from __future__ import annotations

import argparse
import bz2
import json
import lzma
import os
import resource
import tempfile
import time
import zlib
from typing import Any, Callable, Optional

import numpy as np

from pansketch.host_tools.store import payloadcodec

T0 = 1_800_000_000 // 3600 * 3600
SALT = "bench-storage-salt"
DEV = "dev-1"

KINDS: dict[str, dict[str, Any]] = {
    "cs": {"kind": "cs", "d": 4, "w": 2048},
    "cms": {"kind": "cms", "d": 4, "w": 256},
    "tree": {"kind": "cs", "d": 4, "w": 1024, "mode": "tree", "levels": 3},
    "dcs": {"kind": "dcs", "b": 16, "d": 4, "w": 1024},
    "strhh": {"kind": "strhh", "len": 8, "d": 3, "w": 256},
    "dbits": {"kind": "dbits", "d": 12, "w": 512, "mechanism": "dlap", "budget": "1"},
}


def _events(kind: str, i: int, n: int) -> list[Any]:
    from pansketch.host_tools.bench.core import zipf_items
    from pansketch.host_tools.bench.kinds import readings

    if kind == "dcs":
        return [int(x) for x in readings(16, n, i)]
    return zipf_items(n, seed=i + 1)  # type: ignore[return-value]


def real_releases(kind: str, windows: int, events: int = 30_000, cfg: Optional[dict[str, Any]] = None) -> list[bytes]:
    """``windows`` windows' releases of one device of ``kind`` (parameters ``cfg``, default KINDS[kind]),
    by the device core."""
    from pansketch.agent.params import Params
    from pansketch.agent.recorders import make_recorder
    from pansketch.agent.rng import DeterministicSource, Rng

    p = Params(dict(KINDS[kind] if cfg is None else cfg, salt=SALT, device=DEV))
    n = events // 10 if kind == "tree" else events
    with tempfile.TemporaryDirectory() as tmp:
        rec = make_recorder(p, tmp, T0, rng=Rng(DeterministicSource(("bench-storage-" + kind).encode())),
                            log=lambda m: None)
        t = T0
        for i in range(windows):
            rec.add_many(_events(kind, i, n))
            t += 3600
            rec.tick(t)
        return [rec.outbox.read(s) for s in rec.outbox.pending()]


def entropy_bytes(c: np.ndarray) -> float:
    """n * H(empirical distribution of the values), in bytes: the plug-in (maximum likelihood) estimate
    of what an ideal order-0 coder needs. Biased low: on n samples of a distribution with K values it
    misses about (K - 1) / (2 n ln 2) bits per value, several percent for cms (1,024 counters, ~300
    distinct values)."""
    _, k = np.unique(c, return_counts=True)
    return float(-(k * np.log2(k / k.sum())).sum()) / 8


def entropy_mm_bytes(c: np.ndarray) -> float:
    """n * H by the Miller-Madow estimate, in bytes: the plug-in one plus its first-order bias
    (K - 1) / (2 n) nats per value, K the distinct values seen (Miller 1955; Paninski, Neural Computation
    15(6), 2003)."""
    k = np.unique(c).size
    return entropy_bytes(c) + (k - 1) / (2 * np.log(2)) / 8


def pooled_entropy_bytes(cs: list[np.ndarray]) -> float:
    """Per release, n * H of the counters of all ``cs`` pooled (the Miller-Madow estimate over their
    len(cs) * n values): the releases of one device's windows are draws of one distribution of cell
    values, and pooling them shrinks the estimate's bias by that factor. The honest figure to hold a
    release's stored bytes against (docs/HOST.md "Stored encoding")."""
    return entropy_mm_bytes(np.concatenate([c.ravel() for c in cs])) / len(cs)


def planes(stored: bytes, wire: bytes) -> bytes:
    """The byte planes payloadcodec stored for ``wire`` (its frame decompressed, the CBOR head and tail
    taken off): the candidates compress exactly the codec's transform."""
    import zstandard

    raw = zstandard.ZstdDecompressor().decompress(stored[payloadcodec._BODY:])
    _, n, k, _ = payloadcodec._HEAD.unpack_from(stored, 2)
    return raw[len(raw) - k * n:]


def _zlib(level: int, strategy: int = zlib.Z_DEFAULT_STRATEGY) -> Callable[[bytes], bytes]:
    def f(b: bytes) -> bytes:
        o = zlib.compressobj(level, zlib.DEFLATED, -15, 9, strategy)
        return o.compress(b) + o.flush()
    return f


def candidates() -> dict[str, Callable[[bytes], bytes]]:
    out: dict[str, Callable[[bytes], bytes]] = {
        "zlib-1": _zlib(1), "zlib-6": _zlib(6), "zlib-9": _zlib(9), "zlib-rle": _zlib(6, zlib.Z_RLE),
        "lzma-6": lambda b: lzma.compress(b, format=lzma.FORMAT_RAW, filters=[{"id": lzma.FILTER_LZMA2, "preset": 6}]),
        "bz2-9": lambda b: bz2.compress(b, 9),
    }
    try:
        import zstandard

        for lv in (1, 3):
            out["zstd-%d" % lv] = zstandard.ZstdCompressor(level=lv, write_checksum=False).compress
    except ImportError:  # pragma: no cover
        pass
    return out


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def cpu_us(fn: Callable[[], Any], budget_s: float = 0.05) -> float:
    """Best of 3 of the CPU time per call (repeated to at least ``budget_s`` each, process_time)."""
    reps, best = 1, float("inf")
    while True:
        t = time.process_time()
        for _ in range(reps):
            fn()
        dt = time.process_time() - t
        if dt >= budget_s:
            break
        reps *= 4
    for _ in range(3):
        t = time.process_time()
        for _ in range(reps):
            fn()
        best = min(best, (time.process_time() - t) / reps)
    return best * 1e6


def codec_rows(corpus: dict[str, list[bytes]], quick: bool = False) -> list[dict[str, Any]]:
    from pansketch.host_tools.ingest.decode import decode

    cands = candidates()
    rows = []
    for kind, raws in corpus.items():
        rels = [decode(x) for x in raws]
        ctrs = [r.counters().ravel() for r in rels]
        n = ctrs[0].size
        plug = float(np.mean([entropy_bytes(c) for c in ctrs]))
        ent = pooled_entropy_bytes(ctrs) if len(ctrs) > 1 else entropy_mm_bytes(ctrs[0])
        stored = [payloadcodec.encode(x, r.ctr_off, n) for x, r in zip(raws, rels)]
        assert all(payloadcodec.decode(s) == x for s, x in zip(stored, raws))
        head = len(raws[0]) - 4 * n
        row: dict[str, Any] = {
            "kind": kind, "params": KINDS[kind], "releases": len(raws), "counters": n, "wire_bytes": len(raws[0]),
            "header_bytes": head, "entropy_bytes": round(ent, 1), "entropy_bits_per_counter": round(8 * ent / n, 3),
            "entropy_estimate": "Miller-Madow over the %d releases pooled" % len(ctrs) if len(ctrs) > 1
            else "Miller-Madow", "entropy_plugin_bytes": round(plug, 1),
            "entropy_mm_bytes": round(float(np.mean([entropy_mm_bytes(c) for c in ctrs])), 1),
            "stored_bytes": round(float(np.mean([len(s) for s in stored])), 1),
            "encode_us": round(cpu_us(lambda: payloadcodec.encode(raws[0], rels[0].ctr_off, n)), 1),
            "decode_us": round(cpu_us(lambda: payloadcodec.decode(stored[0])), 1),
        }
        # the bound: 1.3 x the counters' entropy plus the fixed part (the CBOR head and tail, stored as sent)
        row["ratio_to_entropy"] = round((row["stored_bytes"] - head) / ent, 3) if ent else None
        row["ratio_to_plugin_entropy"] = round((row["stored_bytes"] - head) / plug, 3) if plug else None
        row["bound_bytes"] = round(1.3 * ent + head, 1)
        if not quick:
            cand: dict[str, Any] = {}
            for name, f in cands.items():
                pl = [planes(s, x) if s[:1] == b"\x00" else x for s, x in zip(stored, raws)]
                for tname, bs in (("planes", pl), ("raw", [c.astype("<i4").tobytes() for c in ctrs])):
                    sz = float(np.mean([len(f(b)) for b in bs]))
                    cand["%s/%s" % (name, tname)] = {"bytes": round(sz, 1), "ratio": round(sz / ent, 3) if ent else None}
                cand["%s/planes" % name]["us"] = round(cpu_us(lambda: f(pl[0])), 1)  # the codec's call alone
            row["candidates"] = cand
        rows.append(row)
    return rows


def _fleet(raws: list[bytes], devices: int) -> list[list[Any]]:
    """Groups of releases of ``devices`` devices (the real releases, each device id patched in)."""
    from pansketch.host_tools.ingest.decode import decode
    from pansketch.host_tools.store.rows import Pending

    groups: list[list[Any]] = []
    cur: list[Any] = []
    for raw in raws:
        for dv in range(devices):
            rel = decode(raw.replace(DEV.encode(), b"d%04d" % dv, 1))
            cur.append(Pending(rel.payload, None, time.time(), rel=rel, device=rel.dev))
            if len(cur) == 256:
                groups.append(cur)
                cur = []
    if cur:
        groups.append(cur)
    return groups


def write_ab(raws: list[bytes], devices: int, rounds: int, tmp: str) -> dict[str, Any]:
    """CPU per release of the SQLite group commit with payloads encoded on the write path vs stored raw
    (the peer), and with them encoded before the timed commit ("pre": what SQLite itself saves on the
    smaller rows), rounds alternating in this process; the file's bytes per release after a checkpoint."""
    from pansketch.host_tools.store.sqlite import Store

    enc = payloadcodec.encode
    modes = ("encoded", "raw", "pre")
    cpu: dict[str, list[float]] = {m: [] for m in modes}
    size: dict[str, float] = {}
    n = 0
    for r in range(rounds):
        for mode in (modes if r % 2 == 0 else modes[::-1]):
            groups = _fleet(raws, devices)
            n = sum(len(g) for g in groups)
            done = {id(p.rel.payload): enc(p.rel.payload, p.rel.ctr_off, p.rel.shape[0] * p.rel.shape[1])
                    for g in groups for p in g} if mode == "pre" else {}
            path = os.path.join(tmp, "%s-%d.db" % (mode, r))
            st = Store(path)
            st.compress = mode != "raw"  # [store] compress
            if mode == "pre":
                payloadcodec.encode = lambda p, o, k: done[id(p)]  # type: ignore[assignment]
            try:
                t = _cpu()
                for g in groups:
                    st.commit_group(g)
                cpu[mode].append((_cpu() - t) / n * 1e6)
            finally:
                payloadcodec.encode = enc  # type: ignore[assignment]
            st.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            st.close()
            size[mode] = os.path.getsize(path) / n
            os.remove(path)
    med = {m: float(np.median(v)) for m, v in cpu.items()}
    return {"releases": n, "rounds": rounds, "cpu_us_per_release": {m: [round(x, 1) for x in v] for m, v in cpu.items()},
            "cpu_us_median": {m: round(v, 1) for m, v in med.items()},
            "cpu_us_delta": round(med["encoded"] - med["raw"], 1),
            "sqlite_saving_us": round(med["raw"] - med["pre"], 1),
            "encode_in_place_us": round(med["encoded"] - med["pre"], 1),
            "file_bytes_per_release": {m: round(size[m], 1) for m in ("encoded", "raw")}}


def _server_cpu(data_dir: str) -> float:
    """CPU seconds of a PostgreSQL server so far: its postmaster and every process it started."""
    from pansketch.host_tools.bench.core import process_cpu_s as _cpu_s

    with open(os.path.join(data_dir, "postmaster.pid")) as f:
        pm = int(f.readline())
    total = _cpu_s(pm)
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open("/proc/%s/stat" % d) as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if ppid == pm:
                total += _cpu_s(int(d))
    return total


def write_ab_pg(raws: list[bytes], devices: int, rounds: int) -> dict[str, Any]:
    """As :func:`write_ab` on PostgreSQL (a server started for it, fsync off): this process's CPU and the
    server's (its sessions and background processes) per release, and the releases table's bytes
    (heap, TOAST, indexes: pg_total_relation_size) per release."""
    from pansketch.host_tools.store import pgserver
    from pansketch.host_tools.store.pg import PgStore

    cpu: dict[str, list[float]] = {"encoded": [], "raw": []}
    srv_cpu: dict[str, list[float]] = {"encoded": [], "raw": []}
    size: dict[str, float] = {}
    n = 0
    srv = pgserver.PgServer.start()
    try:
        for r in range(rounds):
            for mode in (("encoded", "raw") if r % 2 == 0 else ("raw", "encoded")):
                groups = _fleet(raws, devices)
                n = sum(len(g) for g in groups)
                st = PgStore(srv.create_database("ab_%s_%d" % (mode, r)))
                st.compress = mode == "encoded"  # [store] compress
                t, ts = _cpu(), _server_cpu(srv.data)
                for g in groups:
                    st.commit_group(g)
                cpu[mode].append((_cpu() - t) / n * 1e6)
                srv_cpu[mode].append((_server_cpu(srv.data) - ts) / n * 1e6)
                size[mode] = float(st._q("SELECT pg_total_relation_size('releases')")[0][0]) / n
                st.close()
    finally:
        srv.stop()
    med = {m: float(np.median(v)) for m, v in cpu.items()}
    smed = {m: float(np.median(v)) for m, v in srv_cpu.items()}
    return {"releases": n, "rounds": rounds,
            "cpu_us_per_release": {m: [round(x, 1) for x in v] for m, v in cpu.items()},
            "server_cpu_us_per_release": {m: [round(x, 1) for x in v] for m, v in srv_cpu.items()},
            "cpu_us_median": {m: round(v, 1) for m, v in med.items()},
            "server_cpu_us_median": {m: round(v, 1) for m, v in smed.items()},
            "total_cpu_us_delta": round(med["encoded"] + smed["encoded"] - med["raw"] - smed["raw"], 1),
            "releases_table_bytes_per_release": {m: round(v, 1) for m, v in size.items()}}


def table(rows: list[dict[str, Any]], ab: dict[str, dict[str, Any]]) -> str:
    lines = ["| kind | counters | wire bytes | stored bytes | entropy bound (1.3 H + header) | n H bytes (pooled MM) | "
             "stored / H: pooled MM (plug-in) | encode µs | decode µs | SQLite file bytes per release, raw → encoded | "
             "write-path CPU µs per release, raw → encoded (SQLite's own part) |", "|" + "---|" * 11]
    for r in rows:
        a = ab.get(r["kind"])
        f = ("%.0f → %.0f" % (a["file_bytes_per_release"]["raw"], a["file_bytes_per_release"]["encoded"])) if a else ""
        c = ("%.0f → %.0f (SQLite %+.0f)" % (a["cpu_us_median"]["raw"], a["cpu_us_median"]["encoded"],
                                              -a["sqlite_saving_us"]) if a else "")
        ratio = ("%.2f (%.2f)" % (r["ratio_to_entropy"], r["ratio_to_plugin_entropy"]) if r["ratio_to_entropy"]
                 else "-")
        lines.append("| %s | %d | %d | %.0f | %.0f | %.0f | %s | %.0f | %.0f | %s | %s |" % (
            r["kind"], r["counters"], r["wire_bytes"], r["stored_bytes"], r["bound_bytes"], r["entropy_bytes"],
            ratio, r["encode_us"], r["decode_us"], f, c))
    return "\n".join(lines)


def candidate_table(rows: list[dict[str, Any]]) -> str:
    names = [k for k in rows[0].get("candidates", {}) if k.endswith("/planes")]
    if not names:
        return ""
    lines = ["| kind | " + " | ".join(n.split("/")[0] for n in names) + " |", "|---|" + "---|" * len(names)]
    for r in rows:
        c = r["candidates"]
        lines.append("| %s | " % r["kind"] + " | ".join("%.2f× %.0f µs" % (c[n]["ratio"] or 0, c[n]["us"]) for n in names)
                     + " |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--windows", type=int, default=4, help="real releases per kind (windows of one device)")
    ap.add_argument("--devices", type=int, default=64, help="device ids per release in the write-path A/B")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ab-kinds", default="cs,cms,tree,strhh,dbits", help="kinds of the write-path A/B")
    ap.add_argument("--pg", action="store_true", help="also the write-path A/B on PostgreSQL (cs)")
    ap.add_argument("--quick", action="store_true", help="no candidate codecs, one round (CI)")
    ap.add_argument("--no-candidates", action="store_true", help="no candidate codecs (the write-path A/B only)")
    ap.add_argument("--out", default="bench-results/storage.json")
    a = ap.parse_args(argv)
    if a.quick:
        a.windows, a.devices, a.rounds = 1, 4, 1
    corpus = {k: real_releases(k, a.windows) for k in KINDS}
    rows = codec_rows(corpus, quick=a.quick or a.no_candidates)
    ab: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for k in a.ab_kinds.split(","):
            if k:
                ab[k] = write_ab(corpus[k], a.devices, a.rounds, tmp)
    if a.pg:
        ab_pg = write_ab_pg(corpus["cs"], a.devices, a.rounds)
        print("PostgreSQL, cs:", json.dumps(ab_pg))
    res = {"machine_note": "CPU times of a shared 2-core machine (process CPU, not wall time)",
           "load_avg": os.getloadavg(), "kinds": rows, "write_ab": ab}
    if a.pg:
        res["write_ab_postgresql_cs"] = ab_pg
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print(table(rows, ab))
    ct = candidate_table(rows)
    if ct:
        print("\nstored / n H per candidate on the codec's byte planes, compress CPU (the transform apart):\n" + ct)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
