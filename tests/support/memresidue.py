"""The real Pi daemon under a whole-memory intruder: what its processes' RAM still shows.

One scenario runs the real ``pansketch-agent`` (``run`` with a followed file source, or with an
MQTT source subscribed to a real mosquitto that this process publishes each input line to as
one message, publishing to that mosquitto; or ``feed --jobs 2`` on a pipe, whose count worker
is a second process)
with a sped-up clock, feeds it bursts of unique raw items (``secret-mac-<12 hex>``, each 1-4
times), and at chosen moments stops every agent process and reads all its readable memory
(tests/support/memscan.py). The moments, per persist interval:

* ``chunk``   0.8 s after a burst was written (the file source polls every 0.2 s; its chunks
  are counted: "right after a chunk"; an MQTT burst: after its last message was sent);
* ``idle``    0.8 s later, nothing in flight;
* ``persist`` 0.3 s after ``state.bin`` changed (the refresh draw Y was added);
* ``release`` 0.3 s after a release appeared in the outbox (a fresh Z_int opened);
* ``mid``     a few ms after a large burst was written (chunks being counted).

What is searched at each moment, in every process:

* raw items of every burst so far, and their salted SHA-256 digests (the sketch's hash);
* the **exact-recovery attack** (RAM - residual draw - flash = events): the intruder holds the
  counters (located in RAM as the one int32 array within ``BOUND`` of flash + events) and
  ``state.bin``; the residual draw D = counters - state.bin - (events since that snapshot) is
  the draw that turns them into exact events. A *trial* is one (moment, 16-cell window of D):
  it succeeds if those 16 cells of D occur anywhere in the memory of an agent process, as
  int32 or int64 (the agent's arrays and numpy's), other than inside the counters themselves.
  The draws of earlier moments (every Y, Z_int, and Z_out where it can be computed) are
  searched too: any of them found gives the events of its interval exactly;
* the exact per-cell counts of every burst (int32, int64 and float64: numpy's bincount),
  16-cell windows holding at least 3 events.

``PANSKETCH_TEST_NO_WIPE=1`` in the agent's environment turns the wiping off: the negative
control, which must make the same scenario find residue.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
import signal
import struct
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from pansketch.agent import hashing
from pansketch.agent.sketch import Sketch
from pansketch.host_tools.bench.localfleet import agent_toml
from tests.support import memscan
from tests.support.e2e import REPO, SALT, agent_cmd, agent_env

ITEM_RE = rb"secret-mac-[0-9a-f]{12}"
BOUND = 200  # |one draw| stays below this (dgauss sigma 2: 100 sigma; dlap t = 8: P < 4096 e^-25)
PROBE = 16  # cells per probe window
WINDOWS = 72  # probe windows of the residual draw per moment: one trial each
D, W = 4, 1024
TOPIC = "memresidue/wifi"  # the MQTT source's topic (its payloads are the raw items)


@dataclass
class Report:
    moments: list[dict[str, Any]] = field(default_factory=list)
    trials: int = 0
    recovered: int = 0  # trials in which the residual draw was found: exact recovery
    old_draw_hits: int = 0  # windows of earlier draws found
    old_draw_trials: int = 0
    count_hits: int = 0
    count_trials: int = 0
    items_total: int = 0
    bytes_read: int = 0

    def summary(self) -> str:
        lines = ["%-8s %6s %6s %6s %6s %6s %6s %s" % ("moment", "items", "digest", "draw", "olddrw", "counts",
                                                   "ctrs", "MB")]
        for m in self.moments:
            lines.append("%-8s %6d %6d %3d/%-3d %6d %6d %6d %5.0f" % (
                m["what"], m["items"], m["digests"], m["draw_hits"], m["draw_trials"], m["old_draw_hits"],
                m["count_hits"], m["counters_found"], m["mb"]))
        lines.append("exact recovery %d of %d trials; earlier draws found %d of %d windows; chunk counts %d of %d; "
                     "items of %d" % (self.recovered, self.trials, self.old_draw_hits, self.old_draw_trials,
                                      self.count_hits, self.count_trials, self.items_total))
        return "\n".join(lines)


def _state(path: str) -> tuple[int, np.ndarray]:
    """(elo, counters) of a state.bin."""
    with open(path, "rb") as f:
        raw = f.read()
    fmt = "<4sB3x8sIqqIII"
    hl = struct.calcsize(fmt)
    _m, _v, _fp, _seq, elo, _ehi, _part, _nz, n = struct.unpack(fmt, raw[:hl])
    return elo, np.frombuffer(raw[hl:hl + 4 * n], dtype="<i4").astype(np.int64)


class Scenario:
    def __init__(self, tmp: str, command: str, mech: str, port: int, seed: int = 1, no_wipe: bool = False,
                 jobs: int = 2, source: str = "file") -> None:
        self.tmp = tmp
        self.command = command
        self.pub: Any = None
        mqtt = source == "mqtt"
        assert command == "run" or not mqtt
        self.rng = np.random.default_rng(seed)
        self.state_dir = os.path.join(tmp, "state")
        self.src = os.path.join(tmp, "events.log")
        open(self.src, "wb").close()
        if command != "run":
            source = 'type = "stdin"'
        elif mqtt:
            source = 'type = "mqtt"\nhost = "127.0.0.1"\nport = %d\ntopic = "%s"\nfield = "payload"' % (port, TOPIC)
        else:
            source = 'type = "file"\npath = "%s"\nfollow = true' % self.src
        self.cfg = agent_toml(os.path.join(tmp, "agent.toml"), "mem-pi", port, self.state_dir, window_s=600, d=D, w=W,
                              mechanism=mech, source=source, storage_extra='persist_noise = "refresh"', salt=SALT)
        self.prefix = hashing.salt_prefix(SALT)
        self.report = Report()
        if mqtt:
            self.pub = _publisher(port)
        self.items: list[bytes] = []  # every raw item fed so far
        self.digests: list[np.ndarray] = []
        self.since = np.zeros(D * W, dtype=np.int64)  # exact sketch of the events since the last snapshot
        self.snap: Optional[np.ndarray] = None  # the open accumulator's last state.bin (None: none yet)
        self.snap_elo: Optional[int] = None
        self.draws: list[np.ndarray] = []  # residual draws of earlier moments (distinct)
        self.bursts: list[np.ndarray] = []  # exact sketch of each burst
        self.last_ram: Optional[np.ndarray] = None
        self.state_mtime = 0.0
        self.captures: list[Any] = []
        self.outbox_n = 0
        env = agent_env()
        if no_wipe:
            env["PANSKETCH_TEST_NO_WIPE"] = "1"
        window = 600
        now = time.time()
        # start 4.5 persists before a window boundary: persists, then a release, then persists again
        start = (int(now) // window + 1) * window - 270
        extra = ["--clock-start", str(start), "--clock-speed", "5", "-q"]
        if command == "feed":
            extra += ["--jobs", str(jobs), "--timeout", "1"]
        self.proc = subprocess.Popen(agent_cmd(command, self.cfg, *extra), stdin=subprocess.PIPE,
                                     stdout=subprocess.DEVNULL, stderr=open(os.path.join(tmp, "agent.log"), "wb"),
                                     env=env, cwd=REPO)

    # -- input ---------------------------------------------------------
    def burst(self, n_items: int) -> None:
        """n_items unique items, each 1-4 times, shuffled; counted into ``since``."""
        new = [b"secret-mac-" + secrets.token_hex(6).encode() for _ in range(n_items)]
        reps = self.rng.integers(1, 5, size=n_items)
        lines = [x for x, r in zip(new, reps) for _ in range(int(r))]
        self.rng.shuffle(lines)  # type: ignore[arg-type]
        sk = Sketch("cs", D, W, self.prefix, 1)
        for x, r in zip(new, reps):
            sk.update(x.decode(), int(r))
        exact = np.frombuffer(sk.counters, dtype=np.int32).astype(np.int64)
        self.since += exact
        self.bursts.append(exact)
        self.items += new
        for x in new:
            dg = hashlib.sha256(self.prefix + b"s" + x).digest()
            self.digests.append(np.frombuffer(dg, dtype="<u4").copy())
        self.report.items_total = len(self.items)
        if self.pub is not None:  # one message per line, as a sensor bridge publishes readings
            info = None
            for x in lines:
                info = self.pub.publish(TOPIC, x, qos=0)
            if info is not None:
                info.wait_for_publish(30)
            return
        data = b"".join(x + b"\n" for x in lines)
        if self.command == "run":
            with open(self.src, "ab") as f:
                f.write(data)
        else:
            assert self.proc.stdin is not None
            self.proc.stdin.write(data)
            self.proc.stdin.flush()

    # -- the clock's files ---------------------------------------------
    def _state_path(self) -> str:
        return os.path.join(self.state_dir, "state.bin")

    def _outbox(self) -> int:
        d = os.path.join(self.state_dir, "outbox")
        return len([x for x in os.listdir(d) if x.endswith(".cbor")]) if os.path.isdir(d) else 0

    def wait_persist(self, timeout: float = 10.0) -> str:
        """Wait for the next state.bin or release; take it as the new reference. Returns which."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            n = self._outbox()
            if n > self.outbox_n:
                self.outbox_n = n
                self._on_release()
                return "release"
            try:
                st = os.stat(self._state_path())
            except OSError:
                st = None
            if st is not None and st.st_mtime_ns != self.state_mtime:
                self.state_mtime = st.st_mtime_ns
                time.sleep(0.05)
                elo, s = _state(self._state_path())
                self.snap, self.snap_elo = s, elo
                self.since[:] = 0
                return "persist"
            time.sleep(0.01)
        raise TimeoutError("no persist within %g s" % timeout)

    def _on_release(self) -> None:
        # a fresh accumulator: Z_int + the events since (none are written around a boundary)
        self.snap = None
        self.since[:] = 0

    # -- the intruder ----------------------------------------------------
    def pids(self) -> list[int]:
        return [self.proc.pid] + memscan.children(self.proc.pid)

    def _changed(self) -> bool:
        """A persist or release happened since the reference was taken (then the moment's
        reference is stale: its trials are not counted)."""
        try:
            st = os.stat(self._state_path()).st_mtime_ns
        except OSError:
            st = 0
        return st != self.state_mtime or self._outbox() != self.outbox_n

    def probe(self, what: str) -> None:
        """Stop every agent process, read its memory, continue it: fast (tens of ms). What the
        intruder knows then (flash, the events so far) is kept with it; the searches run at the
        end (:meth:`analyze`), so they never delay the agent's clock-driven persists."""
        pids = self.pids()
        with memscan.stopped(pids):
            stale = self._changed()
            snaps = [memscan.Snapshot.of(p) for p in pids]
        self.captures.append((what, snaps, stale, None if self.snap is None else self.snap.copy(), self.since.copy(),
                              len(self.items), len(self.digests), len(self.bursts), len(pids)))

    def analyze(self) -> None:
        items, digests, bursts = self.items, self.digests, self.bursts
        for what, snaps, stale, snap, since, ni, nd, nb, npid in self.captures:
            self.snap, self.since = snap, since
            self.items, self.digests, self.bursts = items[:ni], digests[:nd], bursts[:nb]
            self._analyze(what, snaps, stale, npid)
        self.items, self.digests, self.bursts = items, digests, bursts
        self.captures = []

    def _analyze(self, what: str, snaps: list[memscan.Snapshot], stale: bool, npid: int) -> None:
        pids = [0] * npid
        scan = memscan.Scan(snaps)
        rep = self.report
        m: dict[str, Any] = {"what": what, "mb": scan.size() / 1e6, "pids": len(pids), "stale": stale}
        rep.bytes_read += scan.size()
        found = scan.items(ITEM_RE)
        m["items"] = len(found & set(self.items))
        m["digests"] = sum(scan.find_words(self.digests))
        ref = (self.snap if self.snap is not None else np.zeros(D * W, dtype=np.int64)) + self.since
        # copies of the snapshot itself are what flash holds (the write's buffers): not the counters
        cands = [c for c in scan.find_near(ref, BOUND) if self.snap is None or not np.array_equal(c, self.snap)]
        m["counters_found"] = len(cands)
        m["draw_hits"] = m["draw_trials"] = m["old_draw_hits"] = 0
        if len(cands) >= 1 and what != "mid" and not stale:  # mid-chunk: the counters are not yet state + events
            # Each array near flash + events may be the counters (the recorder keeps two of that
            # shape: the accumulator and the scratch it swaps with): the attack tries every one.
            dnows = [c - ref for c in cands]
            wins = self._windows(dnows[0], WINDOWS)
            needles = [memscan.as_words(dn[a:a + PROBE], dt) for dn in dnows for a in wins for dt in ("<i4", "<i8")]
            hits = scan.find_words(needles)
            per = 2 * len(wins)
            # the counters themselves hold Z_int where nothing was counted and nothing persisted:
            # a match there is the state, not a residue
            inside = set()
            if self.snap is None:
                inside = {i for i, a in enumerate(wins) if not self.since[a:a + PROBE].any()}
            for i, a in enumerate(wins):
                if i in inside:
                    continue
                rep.trials += 1
                m["draw_trials"] += 1
                if any(hits[k * per + 2 * i] or hits[k * per + 2 * i + 1] for k in range(len(dnows))):
                    rep.recovered += 1
                    m["draw_hits"] += 1
            old = [d for d in self.draws if not any(np.array_equal(d, dn) for dn in dnows)]
            on = [memscan.as_words(d[a:a + PROBE], dt) for d in old for a in self._windows(d, 4)
                  for dt in ("<i4", "<i8")]
            oh = scan.find_words(on)
            m["old_draw_hits"] = sum(1 for i in range(0, len(oh), 2) if oh[i] or oh[i + 1])
            rep.old_draw_hits += m["old_draw_hits"]
            rep.old_draw_trials += len(oh) // 2
            for dn in dnows:
                if not any(np.array_equal(d, dn) for d in self.draws):
                    self.draws.append(dn)
        cn = []
        for e in self.bursts:
            for a in self._count_windows(e):
                for dt in ("<i4", "<i8", "<f8"):
                    cn.append(memscan.as_words(e[a:a + PROBE], dt))
        ch = scan.find_words(cn)
        m["count_hits"] = sum(1 for i in range(0, len(ch), 3) if ch[i] or ch[i + 1] or ch[i + 2])
        rep.count_hits += m["count_hits"]
        rep.count_trials += len(ch) // 3
        rep.moments.append(m)
        if os.environ.get("MEMRESIDUE_VERBOSE"):
            print("moment %-8s items %d digests %d draw %d/%d old %d counts %d ctrs %d" % (
                what, m["items"], m["digests"], m["draw_hits"], m["draw_trials"], m["old_draw_hits"],
                m["count_hits"], m["counters_found"]), flush=True)

    def _windows(self, arr: np.ndarray, k: int) -> list[int]:
        """k probe windows at fixed-seed offsets, each with a nonzero value in its first cell (the
        search keys on it), and not all-zero."""
        out: list[int] = []
        r = np.random.default_rng(len(self.report.moments) * 7919 + k)
        tries = 0
        while len(out) < k and tries < 10000:
            tries += 1
            a = int(r.integers(0, len(arr) - PROBE))
            if arr[a] != 0 and np.count_nonzero(arr[a:a + PROBE]) >= 8:
                out.append(a)
        return out

    def _count_windows(self, e: np.ndarray) -> list[int]:
        nz = np.flatnonzero(e)
        out = []
        for a in nz[:: max(1, len(nz) // 8)][:8]:
            a = int(min(a, len(e) - PROBE))
            if e[a] != 0 and np.count_nonzero(e[a:a + PROBE]) >= 3:
                out.append(a)
        return out

    def stop(self) -> int:
        if self.pub is not None:
            self.pub.disconnect()
            self.pub.loop_stop()
            self.pub = None
        if self.proc.stdin is not None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        try:
            self.proc.send_signal(signal.SIGTERM)
        except OSError:
            pass
        try:
            return self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def _publisher(port: int) -> Any:
    import paho.mqtt.client as mqtt

    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="memresidue-sensor")
    c.max_queued_messages_set(0)
    c.connect("127.0.0.1", port)
    c.loop_start()
    return c


def run_scenario(tmp: str, command: str, mech: str, port: int, intervals: int = 6, seed: int = 1,
                 no_wipe: bool = False, burst: int = 300, source: str = "file", big: int = 20000) -> Report:
    """Drive one agent through ``intervals`` persist intervals (a release falls among them),
    probing at each moment; returns the report. ``source``: "file" or "mqtt" (``run`` only);
    ``big``: the items of the large burst probed while it is counted."""
    sc = Scenario(tmp, command, mech, port, seed, no_wipe, source=source)
    try:
        time.sleep(1.5)  # the agent loads numpy, boots its state, subscribes to its file
        kind = sc.wait_persist(30)
        time.sleep(1.0)
        while sc._changed():  # the boot's own write of the state is followed by the first tick's
            kind = sc.wait_persist()
            time.sleep(1.0)
        for k in range(intervals):
            time.sleep(0.3)
            sc.probe(kind)
            sc.burst(burst)
            time.sleep(0.8)
            sc.probe("chunk")
            time.sleep(0.8)
            sc.probe("idle")
            if k == intervals // 2:
                sc.burst(big)  # a few chunks: probed while they are being counted
                time.sleep(0.02)
                sc.probe("mid")
            kind = sc.wait_persist()
        time.sleep(0.3)
        sc.probe(kind)  # a quiet moment after the large burst too (intervals=1 has none otherwise)
        sc.stop()
        sc.analyze()
        return sc.report
    finally:
        sc.stop()
        shutil.rmtree(sc.state_dir, ignore_errors=True)
