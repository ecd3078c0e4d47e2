"""Exclude, include and purge a device: every answer equals that of a store that never received it.

For each kind a store with four honest devices and ``mal-1`` and a store with the honest devices only
are filled through the aggregator's own validate-and-store path (real releases from the real device
core); the real CLI (``pansketch query ... --json``, in-process) must print byte-identical answers for
the second store and for the first after ``pansketch device exclude mal-1``, with ``--exclude-device
mal-1``, and after ``pansketch device purge mal-1`` -- with and without roll-ups, on SQLite and on
PostgreSQL.
"""

from __future__ import annotations

import contextlib
import io
import os
from typing import Any, Iterator

import pytest

from pansketch.agent.params import Params
from pansketch.agent.recorders import make
from pansketch.agent.rng import DeterministicSource, Rng
from pansketch.host_tools import cli, hostconfig
from pansketch.host_tools.ingest.aggregator import Aggregator
from pansketch.host_tools.store import exclusions, pgserver
from pansketch.host_tools.store.backend import open_store
from tests.support.host import SALT, T0, topic, zipf_stream
from tests.support import pg as pgsupport

HONEST = ["h%d" % i for i in range(4)]
MAL = "mal-1"

KINDS: dict[str, dict[str, Any]] = {
    "cs": {"kind": "cs", "d": 4, "w": 64, "mode": "window", "window_s": 3600, "mechanism": "dgauss", "budget": "1/2"},
    "cms": {"kind": "cms", "d": 3, "w": 64, "mode": "keep", "window_s": 3600, "epoch_s": 1800, "mechanism": "dlap",
            "budget": "1"},
    "tree": {"kind": "cs", "d": 3, "w": 64, "mode": "tree", "epoch_s": 3600, "levels": 2, "mechanism": "dgauss",
             "budget": "1/2"},
    "dcs": {"kind": "dcs", "b": 6, "map": [1, 1, 0], "d": 3, "w": 16, "mode": "window", "window_s": 3600,
            "mechanism": "dgauss", "budget": "1/2"},
    "strhh": {"kind": "strhh", "len": 4, "d": 3, "w": 64, "mode": "window", "window_s": 3600, "mechanism": "dgauss",
              "budget": "1/2"},
    "dbits": {"kind": "dbits", "d": 6, "w": 128, "mode": "window", "window_s": 3600, "mechanism": "dlap",
              "budget": "1"},
}
ITEMS = ["item-%d" % i for i in range(6)]
QUERIES: dict[str, list[list[str]]] = {
    "cs": [["freq", *ITEMS], ["topk", "-k", "4", "--candidates", "{cands}"]],
    "cms": [["freq", *ITEMS], ["topk", "-k", "4", "--candidates", "{cands}"]],
    "tree": [["freq", *ITEMS]],
    "dcs": [["quantile", "--q", "0.25", "0.5", "0.9"], ["cdf"]],
    "strhh": [["heavy", "-k", "4"]],
    "dbits": [["distinct"]],
}
WINDOWS = 3


def _events(kind: str, dev: str, k: int) -> list[str]:
    seed = sum(map(ord, dev)) * 10 + k
    if kind == "dcs":
        return [str(int(x.split("-")[1]) % 64) for x in zipf_stream(300, 64, 1.1, seed)]
    if kind == "strhh":
        return ["w%03d" % int(x.split("-")[1]) for x in zipf_stream(300, 40, 1.3, seed)]
    return zipf_stream(300, 40, 1.2, seed)


def _releases(name: str, dev: str, root: str) -> list[bytes]:
    cfg = dict(KINDS[name], device=dev, salt=SALT)
    p = Params(cfg)
    rec = make(p, os.path.join(root, name, dev), T0, rng=Rng(DeterministicSource("excl-%s-%s" % (name, dev))),
               log=lambda _m: None)
    span = p.epoch_s if p.mode == "tree" else p.window_s
    steps = 4 if p.mode == "tree" else WINDOWS
    half = p.epoch_s if p.mode == "keep" else span
    t = T0
    for k in range(steps):
        ev = _events(p.kind, dev, k)
        if p.mode == "keep":  # two epochs per window
            rec.add_many(ev[:150])
            rec.tick(t + half)
            rec.add_many(ev[150:])
        else:
            rec.add_many(ev)
        t += span
        rec.tick(t)
    return [rec.outbox.read(s) for s in rec.outbox.pending()]


@pytest.fixture(scope="module")
def releases(tmp_path_factory: Any) -> dict[str, dict[str, list[bytes]]]:
    root = str(tmp_path_factory.mktemp("excl-releases"))
    return {name: {dev: _releases(name, dev, root) for dev in HONEST + [MAL]} for name in KINDS}


def _fill(db: str, rels: dict[str, list[bytes]], devices: list[str]) -> None:
    agg = Aggregator(hostconfig.from_dict({"fleet": {"salt": SALT}, "aggregator": {"db": db}}))
    try:
        for dev in devices:
            for raw in rels[dev]:
                out = agg.handle(topic(dev), raw, received=T0 + 86400)
                assert out.stored, out
    finally:
        agg.close()


def _conf(tmp: Any, name: str, db: str) -> str:
    path = os.path.join(str(tmp), "%s.toml" % name)
    with open(path, "w") as f:
        f.write('[fleet]\nsalt = "%s"\n[aggregator]\ndb = "%s"\n' % (SALT, db))
    return path


def _cli(*argv: str) -> tuple[int, str]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = cli.main(list(argv))
    return code, buf.getvalue()


def _answers(conf: str, name: str, cands: str, *extra: str) -> list[str]:
    out = []
    for q in QUERIES[name]:
        for rollups in ([], ["--no-rollups"]):
            argv = [a.replace("{cands}", cands) for a in q]
            code, text = _cli("query", "--config", conf, *argv, "--json", *rollups, *extra)
            assert code == 0, (name, argv, text)
            out.append(text)
    return out


def _check_kind(tmp: Any, name: str, rels: dict[str, list[bytes]], db: Any) -> None:
    cands = os.path.join(str(tmp), "cands.txt")
    with open(cands, "w") as f:
        f.write("\n".join(ITEMS + ["item-%d" % i for i in range(6, 40)]) + "\n")
    full, clean, purged = db("full"), db("clean"), db("purged")
    _fill(full, rels, HONEST + [MAL])
    _fill(purged, rels, HONEST + [MAL])
    _fill(clean, rels, HONEST)
    cf, cc, cp = _conf(tmp, name + "-full", full), _conf(tmp, name + "-clean", clean), _conf(tmp, name + "-p", purged)
    want = _answers(cc, name, cands)
    before = _answers(cf, name, cands)
    assert before != want  # mal-1's releases are in the answers
    assert _answers(cf, name, cands, "--exclude-device", MAL) == want
    assert _cli("device", "--config", cf, "exclude", MAL, "--reason", "stolen")[0] == 0
    assert _answers(cf, name, cands) == want
    assert _cli("device", "--config", cf, "include", MAL)[0] == 0
    assert _answers(cf, name, cands) == before  # an exclusion is undone exactly
    code, text = _cli("device", "--config", cp, "purge", MAL)
    assert code == 0 and "release(s) deleted" in text, text
    assert _answers(cp, name, cands) == want


@pytest.mark.parametrize("name", sorted(KINDS))
def test_exclude_include_and_purge_match_a_store_without_the_device_sqlite(name, releases, tmp_path):
    _check_kind(tmp_path, name, releases[name], lambda tag: str(tmp_path / ("%s.db" % tag)))


def test_purge_since_keeps_the_earlier_releases_and_matches(releases, tmp_path):
    """purge --since the second window: the first window of mal-1 stays, answers equal a store given only it."""
    rels = releases["cs"]
    a, b = str(tmp_path / "a.db"), str(tmp_path / "b.db")
    _fill(a, rels, HONEST + [MAL])
    first = {MAL: rels[MAL][:1], **{d: rels[d] for d in HONEST}}
    _fill(b, first, HONEST + [MAL])
    ca, cb = _conf(tmp_path, "a", a), _conf(tmp_path, "b", b)
    code, text = _cli("device", "--config", ca, "purge", MAL, "--since", str(T0 + 3600), "--json")
    assert code == 0 and '"releases_deleted": %d' % (len(rels[MAL]) - 1) in text, text
    cands = str(tmp_path / "c.txt")
    with open(cands, "w") as f:
        f.write("\n".join(ITEMS) + "\n")
    assert _answers(ca, "cs", cands) == _answers(cb, "cs", cands)


def test_purge_refuses_what_retention_pruned(releases, tmp_path):
    """A rolled-up release whose payload retention pruned cannot be subtracted: refused, nothing changed."""
    db = str(tmp_path / "r.db")
    _fill(db, releases["cs"], HONEST + [MAL])
    st = open_store(db)
    try:
        assert st.prune(T0 + 10 * 86400) > 0
        with pytest.raises(exclusions.PurgeError, match="pruned by retention"):
            exclusions.purge(st, MAL)
        assert st.releases(devices=[MAL])
    finally:
        st.close()


@pytest.fixture(scope="module")
def pg() -> Iterator[pgserver.PgServer]:
    yield from pgsupport.server()


_N = iter(range(10 ** 6))


@pytest.mark.parametrize("name", ["cs", "cms", "dcs", "dbits"])
def test_exclude_include_and_purge_match_a_store_without_the_device_postgresql(name, releases, tmp_path, pg):
    _check_kind(tmp_path, name, releases[name], lambda tag: pg.create_database("x%s%s%d" % (name, tag, next(_N))))


def test_retention_keeps_the_payloads_of_excluded_and_kept_devices(releases, tmp_path):
    """prune skips an excluded device and the devices the caller keeps (the flagged ones): a purge can
    still subtract them afterwards, and matches a store without the device."""
    db, clean = str(tmp_path / "k.db"), str(tmp_path / "c.db")
    _fill(db, releases["cs"], HONEST + [MAL])
    _fill(clean, releases["cs"], HONEST)
    st = open_store(db)
    try:
        assert exclusions.set_excluded(st, MAL, True, "stolen")
        assert st.prune(T0 + 10 * 86400, keep=["h0"]) > 0
        kept = {r.device for r in st.releases(with_payload=True) if r.payload}
        assert kept == {MAL, "h0"}
        assert exclusions.purge(st, MAL).releases == len(releases["cs"][MAL])
        assert exclusions.set_excluded(st, MAL, False)
    finally:
        st.close()
    st, sc = open_store(db, readonly=True), open_store(clean, readonly=True)
    try:
        from pansketch.host_tools.query import core as query

        a, _ = query.select_merged(st, salt=SALT)
        b, _ = query.select_merged(sc, salt=SALT)
        assert (a.counters == b.counters).all() and a.noise == b.noise and a.devices == b.devices
        assert (a.releases, a.t0, a.t1, a.windows) == (b.releases, b.t0, b.t1, b.windows)
    finally:
        st.close()
        sc.close()
