"""``pansketch-agent``: the Raspberry Pi daemon (source -> Recorder -> outbox -> MQTT).

CPython only (argparse, threads, paho-mqtt): **not** part of the MicroPython
device core. The counting, noise and crash-safe commit protocol are the
device core's (agent.recorder, DESIGN.md "Release modes"); this module only
wires a source, the clock and the publisher around it.

Commands::

    pansketch-agent run   --config FILE   # long-running daemon
    pansketch-agent feed  --config FILE   # events on stdin, deliver, exit
    pansketch-agent check --config FILE   # validate, print noise and guarantee

Exit codes: 0 success, 1 could not deliver within --timeout (releases stay in
the outbox and go out with the next run), 2 configuration error (one line
naming the key), 3 other runtime errors (state directory unusable, ...).
"""

from __future__ import annotations

import argparse
import gc
import os
import queue
import signal
import sys
import threading
import time
from typing import Any, Callable, Optional

PROG = "pansketch-agent"
EXIT_OK, EXIT_UNDELIVERED, EXIT_CONFIG, EXIT_RUNTIME = 0, 1, 2, 3
_GC_HELD = False  # cli() holds the cyclic GC off while modules load; Agent.main turns it back on
SEED_ENV = "PANSKETCH_INSECURE_SEED"


class Clock:
    """UTC seconds; optionally shifted/scaled for tests and the demo.

    ``start`` pins the time at start-up, ``speed`` scales its progress
    (0 freezes it). Only release timing depends on the clock, never noise.
    """

    def __init__(self, start: Optional[float] = None, speed: float = 1.0) -> None:
        self.start = start
        self.speed = speed
        self.t0 = time.time() if start is None else start
        self.m0 = time.monotonic()
        self.real = start is None and speed == 1.0

    def now(self) -> int:
        if self.real:
            return int(time.time())
        return int(self.t0 + (time.monotonic() - self.m0) * self.speed)

    def seconds(self, real: float) -> float:
        """Simulated seconds -> real seconds to wait (>= 0.05)."""
        if self.speed <= 0:
            return 1.0
        return max(0.05, real / self.speed)


def _logger(device: str, quiet: bool = False) -> Callable[[str], None]:
    lock = threading.Lock()
    muted = [quiet]

    def log(msg: str) -> None:
        if muted[0]:
            return
        with lock:
            try:
                sys.stderr.write("%s[%s]: %s\n" % (PROG, device, msg))
                sys.stderr.flush()
            except (OSError, ValueError):  # stderr closed (`feed 2>&1 | head -1`): keep working, silently
                muted[0] = True

    return log


def _die(code: int, msg: str) -> int:
    try:
        sys.stderr.write("%s: %s\n" % (PROG, msg))
        sys.stderr.flush()
    except (OSError, ValueError):  # nobody reads stderr any more; the exit code still tells
        pass
    return code


def _make_rng(args: argparse.Namespace, log: Callable[[str], None]) -> Any:
    from agent.rng import DeterministicSource, NoEntropyError, Rng, SystemSource

    seed = args.insecure_seed or os.environ.get(SEED_ENV)
    if seed:
        log("WARNING: --insecure-seed / %s is set: noise is DETERMINISTIC and gives NO privacy. "
            "For tests and reproductions only." % SEED_ENV)
        return Rng(DeterministicSource(seed))
    try:
        try:  # whole-array noise draws with numpy (agent/pi/bulknoise.py): same distributions, faster
            from agent.pi.bulknoise import BulkRng
        except ImportError:
            return Rng(SystemSource())
        return BulkRng(SystemSource())
    except NoEntropyError as exc:
        raise SystemExit(_die(EXIT_RUNTIME, "refusing to start: %s" % exc))


class Agent:
    """One agent process: config, recorder, source queue, publisher, clock."""

    def __init__(self, cfg: Any, args: argparse.Namespace, source_type: Optional[str] = None,
                 workers: Optional[list[Any]] = None, early: Any = None) -> None:
        from agent.pi.publisher import Publisher
        from agent.recorders import make
        from agent.pi.sources import make_source

        self.cfg = cfg
        self.args = args
        self.log = _logger(cfg.device, args.quiet)
        self.clock = Clock(args.clock_start, args.clock_speed)
        rng = _make_rng(args, self.log)
        self.rec = make(cfg.params, cfg.state_dir, self.clock.now(), rng=rng, log=self.log,
                        outbox_max=cfg.outbox_max)
        self.q: "queue.Queue[Any]" = queue.Queue(maxsize=8)  # few raw events in flight (pan-privacy)
        scfg = cfg.source
        if source_type is not None and source_type != scfg.type:
            from agent.pi.config import SourceConfig

            scfg = SourceConfig(type=source_type)
        self.source = make_source(scfg, self.q, self.log, cfg.device + "-source")
        # cms/cs count raw line chunks in bulk (agent.pi.batch.add_raw); other kinds get parsed batches
        self.source.raw = cfg.params.kind in ("cms", "cs")
        self.pub = Publisher.from_config(cfg, self.rec.outbox, self.log, clock=self.clock.now)
        self.pub.next_seq = lambda: self.rec.seq
        self.stopping = threading.Event()
        self.failed = False
        self.workers: list[Any] = list(workers or ())  # feed --jobs: count worker processes (agent/pi/countworker.py)
        self.chunks_here = 0  # raw chunks counted in this process / by the workers (the last log line of pump)
        self.chunks_handed = 0
        # feed --jobs: the input's start, read and handed to the workers while this process started
        # (agent.pi.countworker.Early): its items come before the queue's, and the source goes on after it
        self.early = early
        self.pre: list[Any] = []
        if early is not None:  # taken, not copied: a chunk counted here must not stay referenced there
            self.pre, early.items = early.items, []
            self.source.resume(early.reader, early.at_end)

    def boundary(self) -> int:
        return self.rec.ehi * self.cfg.params.epoch_s

    def tick(self) -> None:
        self._settle()  # chunks a worker is counting arrived before this tick: they count in this epoch
        if self.rec.tick(self.clock.now()):
            self.pub.wake()

    def _raw_adder(self, sk: Any, data: bytes, _weights: Any) -> None:
        from agent.pi.batch import add_raw

        add_raw(sk, data, self.source.warn)

    def _hand_over(self, data: bytes) -> bool:
        """Give a raw chunk to a count worker with room (taking the cells of what it finished
        first); False when every worker is full (or none is left): the caller counts it."""
        if self.early is not None and self.early.busy():
            return False  # the start of the input is still being written to the workers: nothing between
        for wk in list(self.workers):
            while wk.alive and wk.done():
                self._take(wk)
            if not wk.alive or not wk.room():
                continue
            if wk.chunks and self.source.ended and self.q.qsize() <= len(wk.chunks) + 1:
                continue  # the input's last chunks (the queue's last item may be its end): queued behind
                # the worker's, this one would finish last while this process waited
            if wk.give(data):
                self.chunks_handed += 1
                return True
            self._fail(wk, "it stopped taking input")
        return False

    def _take(self, wk: Any) -> None:
        """Add the cells of the oldest chunk ``wk`` counted; if it died or went silent, count
        every chunk it still had here."""
        from agent.pi.batch import add_cells

        cells = wk.take()
        if cells is not None:
            self.rec.add_many(cells, None, adder=add_cells)
            return
        self._fail(wk, "it died or did not answer within %g s" % wk.answer_s)

    def _fail(self, wk: Any, why: str) -> None:
        """Kill a worker that failed and count every chunk it still had here: nothing lost, and
        nothing twice (killed first, it can no longer answer)."""
        wk.kill()
        if self.early is not None:
            self.early.stop()  # the hand-over may be writing to it: over before its pipes close
        wk.close(kill=True)
        self.workers.remove(wk)
        self.log("count worker %d left (%s); counting with %d process(es)" % (wk.pid, why, len(self.workers) + 1))
        left, wk.chunks = wk.chunks, []
        while left:
            self.rec.add_many(left.pop(0), None, adder=self._raw_adder)
            self.chunks_handed -= 1
            self.chunks_here += 1

    def _settle(self) -> None:
        """Wait for every chunk in flight and add it (before a tick and when counting ends)."""
        for wk in list(self.workers):
            while wk.alive and wk.chunks:
                self._take(wk)

    def pump(self) -> bool:
        """Count events and tick the clock until stopped (False) or end of input (True)."""
        helpers = len(self.workers)
        try:
            return self._pump()
        finally:
            self.pre = []  # on a stop: the input's start not reached is dropped like the queue
            if self.early is not None:
                self.early.stop()  # before any pipe closes
            self._settle()
            for wk in self.workers:  # not needed any more: their memory goes back now
                wk.close()
            self.workers = []
            if helpers:
                self.log("counted %d input chunk(s), %d of them in %d helper process(es)"
                         % (self.chunks_here + self.chunks_handed, self.chunks_handed, helpers))

    def _pump(self) -> bool:
        from agent.pi.batch import add_batch
        from agent.pi.countworker import Ticket
        from agent.pi.sources import EOF, RawLines, SourceFailed

        tick_real = self.clock.seconds(1.0)
        next_tick = time.monotonic()
        while not self.stopping.is_set():
            wait = next_tick - time.monotonic()
            try:
                if self.pre:  # the input's start (Early): before the queue, in order
                    c = self.pre.pop(0)
                    batch = c if type(c) is Ticket else RawLines(c)
                    del c
                else:
                    batch = self.q.get(timeout=wait) if wait > 0 else self.q.get_nowait()
            except queue.Empty:
                batch = ()
            if batch is EOF:
                return True
            if isinstance(batch, SourceFailed):
                self.log("event source failed: %s" % batch.reason)
                self.failed = True
                return False
            if time.monotonic() >= next_tick:
                self.tick()
                next_tick = max(next_tick + tick_real, time.monotonic())
            if batch:
                if self.clock.now() >= self.boundary():
                    # Events after an epoch end belong to the next epoch, but the
                    # release is committed (and the publisher woken) only on the
                    # scheduled tick: committing on event arrival would make the
                    # publish time tell whether an event came in the first second
                    # after the boundary. Hold the batch until that tick.
                    if not self.stopping.wait(max(0.0, next_tick - time.monotonic())):
                        self.tick()
                        next_tick = max(next_tick + tick_real, time.monotonic())
                if type(batch) is Ticket:
                    while not batch.done.wait(0.1):  # its hand-over was tried (so were the ones before)
                        if self.stopping.is_set():
                            return False
                    if batch.ok and batch.worker in self.workers:
                        batch.worker.reach(batch.data)  # its answer is the next one owed
                        self.chunks_handed += 1
                        while batch.worker.alive and batch.worker.done():
                            self._take(batch.worker)
                    else:  # its worker failed: counted here
                        self.rec.add_many(batch.data, None, adder=self._raw_adder)
                        self.chunks_here += 1
                    batch.data = b""
                elif type(batch) is RawLines:
                    if not (self.workers and self._hand_over(batch.data)):
                        self.rec.add_many(batch.data, None, adder=self._raw_adder)  # cms/cs only (Agent.__init__)
                        self.chunks_here += 1
                    batch.data = b""
                else:
                    items, weights = batch
                    self.rec.add_many(items, weights, adder=add_batch)  # numpy path; counters wrap mod 2^32
                    del items, weights
                del batch
        return False

    def _flush_when_room(self, timeout: Optional[float]) -> bool:
        """Commit the final release; if the outbox is full (outbox_max), wait up
        to ``timeout`` for the host to acknowledge enough to make room."""
        if self.rec.flush(self.clock.now()):
            return True
        if not self.rec.outbox.full():
            return False  # a real write failure (disk): nothing to wait for
        self.log("the outbox holds its limit of %d releases; waiting for the host to acknowledge some"
                 % self.rec.outbox.limit)
        deadline = None if not timeout else time.monotonic() + timeout
        self.pub.wake()
        while self.rec.outbox.full() and not self.stopping.is_set():
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return self.rec.flush(self.clock.now())

    def main(self, finite_timeout: Optional[float]) -> int:
        def on_signal(signum: int, frame: Any) -> None:
            self.stopping.set()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        p = self.cfg.params
        pending = len(self.rec.outbox.pending())
        self.log("device %s: %s sketch d=%d w=%d, mode %s, window %d s, epoch %d s, %s budget %d/%d; "
                 "%d release(s) waiting in the outbox; broker %s:%d%s"
                 % (p.device, p.kind, p.d, p.w, p.mode, p.window_s, p.epoch_s, p.mechanism, p.budget[0],
                    p.budget[1], pending, self.cfg.broker.host, self.cfg.broker.port,
                    " (TLS)" if self.cfg.broker.tls else ""))
        # the counting code (numpy: 0.1-0.3 s to import) is loaded before "online" goes out, so an
        # agent that says it is online counts what it is given at once
        import agent.pi.batch  # noqa: F401
        if _GC_HELD and not gc.isenabled():  # off while the modules loaded (cli); objects made so far stay
            gc.freeze()
            gc.enable()
        self.pub.start()
        self.source.start()
        ended = self.pump()
        code = EXIT_OK
        if ended and getattr(self.args, "no_flush", False):
            # deliver only what waits in the outbox. The open window is NOT skipped because it is
            # empty: that choice is the operator's flag, never the data (a release that exists only
            # when events were counted would tell that none were); it goes out at its boundary.
            self.rec.persist(self.clock.now())
            self.log("--no-flush: the open window stays in the noisy state until its boundary; "
                     "delivering the %d release(s) in the outbox" % len(self.rec.outbox.pending()))
            ended = False
            code = EXIT_OK
            self.pub.wake()
            if not self.pub.wait_delivered(finite_timeout, self.stopping):
                left = self.rec.outbox.pending()
                self.log("%d release(s) not stored by the host within %g s (seq %s); they stay in %s"
                         % (len(left), finite_timeout or 0, _seq_list(left), self.rec.outbox.dir))
                code = EXIT_UNDELIVERED
            else:
                self.log("all releases stored by the host (next seq %d)" % (self.rec.seq,))
            self.source.stop()
            self.pub.stop()
            return code
        if ended:
            # end of a batch input: release early (DESIGN.md allows it for batch replays). Also with
            # no events at all (feed < /dev/null): whether a release exists must not depend on the
            # data; --no-flush is the way to only deliver the outbox.
            if not self._flush_when_room(finite_timeout):
                self.rec.persist(self.clock.now())
                self.log("could not commit the final release (see above); the noisy state is saved and is "
                         "released by the next run or feed")
                code = EXIT_RUNTIME
            self.pub.wake()
            n = len(self.rec.outbox.pending())
            refused_before = self.rec.outbox.rejected()
            ok = self.pub.wait_delivered(finite_timeout, self.stopping)
            refused = self.rec.outbox.rejected() - refused_before
            if not ok:
                left = self.rec.outbox.pending()
                why = self.pub.last_error or ("not connected to the broker" if not self.pub.connected else
                                              "the host (pansketch aggregate) has not acknowledged them: is an "
                                              "aggregator subscribed?")
                if self.stopping.is_set():
                    why = "interrupted"
                self.log("%d of %d release(s) not stored by the host within %g s (seq %s): %s; they stay in %s "
                         "and are re-sent until the host acknowledges them (next run or feed)"
                         % (len(left), n, finite_timeout or 0, _seq_list(left), why, self.rec.outbox.dir))
                code = code or EXIT_UNDELIVERED
            elif refused > 0:
                self.log("the host refused %d release(s) for good (its reason is logged above and in "
                         "pansketch status); they are kept in %s/rejected, not re-sent" % (refused, self.rec.outbox.dir))
                code = code or EXIT_UNDELIVERED
            elif code == EXIT_OK:
                self.log("all releases stored by the host (next seq %d)" % (self.rec.seq,))
        else:
            self.rec.persist(self.clock.now())
            self.log("stopping; noisy state saved, %d release(s) waiting in the outbox"
                     % len(self.rec.outbox.pending()))
            if self.failed:
                code = EXIT_RUNTIME
        self.source.stop()
        self.pub.stop()
        return code


def _seq_list(seqs: list[int], most: int = 8) -> str:
    if len(seqs) <= most:
        return ", ".join(str(s) for s in seqs)
    return "%s, ... %d" % (", ".join(str(s) for s in seqs[:most]), seqs[-1])


def _load(path: str) -> Any:
    from agent.pi.config import ConfigError, load

    try:
        return load(path)
    except ConfigError as exc:
        raise SystemExit(_die(EXIT_CONFIG, "config error: %s" % exc))


def probe_broker(broker: Any, client_id: str, timeout: float) -> tuple[bool, str]:
    """Connect once to ``broker`` (TCP, TLS, MQTT v5 CONNECT with its credentials) and disconnect.

    Returns (ok, what happened): the broker's CONNACK, or the exact error
    (connection refused, DNS, TLS verification, bad credentials, timeout).
    Publishes nothing and subscribes to nothing.
    """
    import ssl

    import paho.mqtt.client as mqtt

    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5)
    c.connect_timeout = timeout
    if broker.username is not None:
        c.username_pw_set(broker.username, broker.password)
    result: list[Any] = []
    c.on_connect = lambda _c, _u, _f, rc, _p=None: result.append(rc)
    t0 = time.monotonic()
    try:
        if broker.tls is not None:
            c.tls_set(ca_certs=broker.tls.ca, certfile=broker.tls.cert, keyfile=broker.tls.key)
        c.connect(broker.host, broker.port, keepalive=max(5, int(timeout) + 5))
    except ssl.SSLError as exc:
        return False, "TLS: %s" % (exc.reason or exc)
    except (OSError, ValueError) as exc:  # refused, unreachable, DNS, timeout, unreadable CA file
        return False, str(exc) or type(exc).__name__
    try:
        deadline = t0 + timeout
        while not result and time.monotonic() < deadline:
            rc = c.loop(timeout=0.1)
            if rc != mqtt.MQTT_ERR_SUCCESS and not result:
                return False, "connection closed before the broker answered (%s)" % mqtt.error_string(rc)
        if not result:
            return False, "no answer to CONNECT within %g s" % timeout
        if result[0].is_failure:
            return False, "broker refused the connection: %s" % result[0]
        return True, "connection accepted (%.0f ms)" % ((time.monotonic() - t0) * 1000)
    finally:
        try:
            c.disconnect()
            c.loop(timeout=0.1)
        except Exception:  # pragma: no cover - best effort
            pass


def cmd_check(args: argparse.Namespace) -> int:
    from agent import calibrate, release
    from agent.sketch import new_counters
    from agent.pi.tomlconf import placeholder_salt_warning

    cfg = _load(args.config)
    p = cfg.params
    name, g = calibrate.guarantee(p.noise, 1 if p.kind == "dbits" else p.d, p.clip, p.arrays)
    elo = int(time.time()) // p.epoch_s  # today's epoch numbers: the same metadata widths as a real release
    size = len(release.encode(p, 0, elo, elo + 1, 0, new_counters(p.cells)))
    if p.mode == "tree":  # a node of today's largest level: the same widths as a real one
        lv = p.levels - 1
        a = elo - elo % (1 << lv)
        size = len(release.encode(p, 0, a, a + (1 << lv), 0, new_counters(p.cells), 2, lv))
    print("config %s is valid" % args.config)
    print("device      %s" % p.device)
    if p.kind == "dbits":  # d levels of w bits; a release is d noisy counts (agent/dbits.py)
        print("sketch      dbits: %d levels of %d bits (%d bits in RAM); a release holds %d noisy counts"
              % (p.d, p.w, p.d * p.w, p.d))
    else:
        print("sketch      %s%s d=%d w=%d clip=%d (%d counters)"
              % (p.kind, " b=%d (%d levels)" % (p.b, p.dcs_levels) if p.kind == "dcs" else "", p.d, p.w, p.clip,
                 p.cells))
        print("capacity    a cell wraps (mod 2^32) after %d events of full weight %d in one window"
              % ((2**31 - 1) // p.clip, p.clip))
    if p.kind == "strhh":  # issue 23: the memory it takes and the noise a node estimate carries
        import math

        def _var(spec):
            t = spec.num / spec.den
            return t if spec.mech == "dgauss" else 2 * math.exp(-1 / t) / (1 - math.exp(-1 / t)) ** 2

        sd = ((_var(p.noise) + _var(p.inoise)) / p.d) ** 0.5
        print("strhh       len=%d prefix levels (one event updates all), %d bytes per counter array, %d arrays in RAM"
              " (boards: python -m firmware.memory --config pansketch.json says which w fits)"
              % (p.b, 4 * p.cells, 3 if p.shadow else 2))
        print("  error     noise sd of a node estimate (about that of the mean of d cells: internal + output draw): %.0f "
              "events per device window; a string holding 2%% of 10^5 events (2000) is %.0f sd above it"
              % (sd, 2000 / sd))
        print("  boards    python -m firmware.memory --config pansketch.json: which len, d, w fit each board, the"
              " node noise at 10^5 events and the recall measured at the Pico size (len=6 d=5 w=80)")
    if p.mode == "tree":
        print("mode        tree, L = %d levels (one event updates %d arrays), epoch %d s, horizon 2^%d epochs = %d s"
              % (p.levels, p.levels, p.epoch_s, p.levels - 1, p.window_s))
        print("memory      %d accumulators%s + 1 scratch = %d bytes of counters"
              % (p.levels, " + %d shadows" % p.levels if p.shadow else "",
                 4 * (p.levels * (2 if p.shadow else 1) + 1) * p.d * p.w))
    else:
        print("mode        %s, window %d s, epoch %d s" % (p.mode, p.window_s, p.epoch_s))
    what = "discrete Gaussian sigma^2" if p.noise.mech == "dgauss" else "discrete Laplace scale t"
    if p.shadow:
        print("noise       %s = %s per cell output; %s internal (half the budget each for the accumulator "
              "and its flash track)" % (what, calibrate.ratio_str((p.noise.num, p.noise.den)),
                                        calibrate.ratio_str((p.inoise.num, p.inoise.den))))
    else:
        print("noise       %s = %s per cell, drawn twice (internal + output)"
              % (what, calibrate.ratio_str((p.noise.num, p.noise.den))))
    per = p.persists_per_epoch()
    print("persists    every %d s (%d per epoch); persist_noise %s -> %s: %s"
          % (p.persist_s, per, p.persist_noise, "shadow" if p.shadow else "refresh",
             "a release carries 1 internal draw whatever the persists (+1 per persist before a restart); "
             "one more array in RAM" if p.shadow else
             "a release carries 1 + %d internal draws (one per persist and restart)" % per))
    print("guarantee   %s = %s for each event, against all releases plus one intrusion (docs/PRIVACY.md)"
          % (name, calibrate.ratio_str(g)))
    print("release     %d bytes to %s%s" % (size, cfg.topic("release"),
                                            ", %.3f releases per epoch on average" % (2 - 2.0 ** (1 - p.levels))
                                            if p.mode == "tree" else ""))
    from agent.pi import plan

    lengths = (1, 24, 168, 720, 10080) if not args.range_epochs else tuple(args.range_epochs)
    if p.kind not in ("dcs", "dbits", "strhh"):  # tree mode is for cms/cs only: nothing to compare for the others
        for line in plan.report(p, lengths, args.levels):
            print(line)
    if args.events:
        for line in plan.interval_advice(p, args.events, args.target_error):
            print(line)
    print("source      %s" % cfg.source.type)
    print("state dir   %s" % cfg.state_dir)
    warning = placeholder_salt_warning("device.salt", p.salt, "on every device and in host.toml")
    where = "%s:%d%s" % (cfg.broker.host, cfg.broker.port, " TLS" if cfg.broker.tls else "")
    code = EXIT_OK
    source_failed = False
    ok_main = True
    if args.offline:
        print("broker      %s: not tried (--offline)" % where)
    else:
        sys.stdout.flush()
        ok, what = probe_broker(cfg.broker, cfg.device + "-check", args.timeout)
        ok_main = ok
        print("broker      %s: %s" % (where, "OK, " + what if ok else "FAILED: " + what))
        if not ok:
            code = EXIT_UNDELIVERED
        if cfg.source.type == "mqtt":  # the local broker of the raw readings: down means nothing is counted
            src = cfg.source
            swhere = "%s:%d%s" % (src.host, src.port, " TLS" if src.tls else "")
            sys.stdout.flush()
            sok, swhat = probe_broker(src, cfg.device + "-check-source", args.timeout)
            print("source mqtt %s topic %s: %s" % (swhere, src.topic, "OK, " + swhat if sok else "FAILED: " + swhat))
            if not sok:
                code = EXIT_UNDELIVERED
                source_failed = True
    sys.stdout.flush()
    if warning:
        _die(0, "WARNING: " + warning)
    if source_failed:
        _die(0, "cannot reach the local source broker %s:%d: the agent would count no events until it answers"
             % (cfg.source.host, cfg.source.port))
    if code != EXIT_OK and not (source_failed and ok_main):
        _die(0, "cannot reach the broker (the config itself is valid; the agent would count and keep its releases "
                "in the outbox until it can); --offline skips this test")
    return code


def _stdin_is_devnull() -> bool:
    try:
        a, b = os.fstat(0), os.stat(os.devnull)
    except (OSError, ValueError):
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def cmd_run(args: argparse.Namespace, feed: bool = False) -> int:
    from agent.storage import StateError

    cfg = _load(args.config)
    from agent.pi.tomlconf import placeholder_salt_warning

    warning = placeholder_salt_warning("device.salt", cfg.params.salt, "on every device and in host.toml")
    if warning and not args.quiet:
        _die(0, "WARNING: " + warning)
    if not feed and cfg.source.type == "stdin" and _stdin_is_devnull():
        return _die(EXIT_CONFIG, "config error: source.type: is 'stdin' but standard input is /dev/null "
                    "(a systemd service?); configure a 'file' or 'mqtt' source, or pipe events into 'feed'")
    # count workers first: forked before the recorder loads the noisy state or draws noise, they
    # never hold a copy of either (agent/pi/countworker.py)
    workers = _start_workers(cfg, args) if feed else []
    early = None
    try:
        if workers:
            from agent.pi.countworker import Early, read_now
            from agent.pi.sources import FdLineReader, Warner

            # what is on standard input already goes to the workers while the modules load and the
            # state boots (agent.pi.countworker.Early)
            rd = FdLineReader(Warner(_logger(cfg.device, args.quiet)))
            chunks, at_end = read_now(_stdin_fd(), rd, sum(wk.early for wk in workers))
            early = Early(workers, chunks, rd, at_end)
            del chunks
        try:
            agent = Agent(cfg, args, "stdin" if feed else None, workers, early)
        except StateError as exc:
            return _die(EXIT_RUNTIME, "state error: %s" % exc)
        except OSError as exc:
            return _die(EXIT_RUNTIME, "cannot use state directory %s: %s" % (cfg.state_dir, exc))
        timeout = args.timeout if args.timeout and args.timeout > 0 else None
        return agent.main(timeout)
    finally:
        if early is not None:
            early.stop()  # before any pipe closes
        for wk in workers:
            wk.close()


def _stdin_fd() -> int:
    try:
        return sys.stdin.fileno()
    except (AttributeError, OSError, ValueError):  # no real standard input (the source says so)
        return -1


def _start_workers(cfg: Any, args: argparse.Namespace) -> list[Any]:
    """``feed --jobs N``: N - 1 count worker processes (cms/cs, whose chunks go to agent.pi.batch)."""
    p = cfg.params
    jobs = args.jobs
    if jobs is None:
        from agent.pi.countworker import default_jobs

        jobs = default_jobs()
    if jobs <= 1 or p.kind not in ("cms", "cs"):
        return []
    # the batch path (numpy) is imported once, before the fork: its pages are shared and a worker
    # counts at once; it holds no state (no noise, no counters) to copy
    import agent.pi.batch  # noqa: F401
    from agent import hashing
    from agent.pi.countworker import CountWorker

    log = _logger(cfg.device, args.quiet)
    workers: list[Any] = []
    for _ in range(jobs - 1):
        try:
            workers.append(CountWorker.start(p.kind, p.d, p.w, hashing.salt_prefix(p.salt), p.clip, log, workers))
        except OSError as exc:
            log("counting with %d process(es), not %d: cannot start a count worker (%s)"
                % (len(workers) + 1, jobs, exc))
            break
    return workers


class _OneLineParser(argparse.ArgumentParser):
    """Usage errors: one line on stderr, exit 2 (subparsers inherit the class)."""

    def error(self, message: str) -> Any:
        self.exit(EXIT_CONFIG, "%s: error: %s (see %s --help)\n" % (self.prog, message, self.prog))


def _jobs(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if not 1 <= n <= 64:
        raise argparse.ArgumentTypeError("must be a whole number from 1 to 64, not %r" % text)
    return n


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(
        prog=PROG,
        description="pansketch device agent: count events into a pan-private noisy sketch and publish only "
        "noisy releases (CBOR, MQTT QoS 1) at clock-aligned window/epoch boundaries. The config file "
        "format is documented in docs/AGENT.md; see examples/agent.toml.",
        epilog="Exit codes: 0 ok, 1 releases not stored by the host within --timeout (they stay in the outbox), "
        "2 configuration error, 3 runtime error.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    def common(p: argparse.ArgumentParser, timeout: float) -> None:
        p.add_argument("--config", "-c", required=True, metavar="FILE", help="agent TOML config (docs/AGENT.md)")
        p.add_argument("--timeout", type=float, default=timeout, metavar="SECONDS",
                       help="at end of a finite input, how long to wait until the host (pansketch aggregate) "
                       "has stored every release (0 = forever; default %(default)s)")
        p.add_argument("--quiet", "-q", action="store_true", help="no log lines on stderr")
        t = p.add_argument_group("testing and demos only")
        t.add_argument("--clock-start", type=float, metavar="UTC_SECONDS",
                       help="pretend the UTC clock reads this at start-up")
        t.add_argument("--clock-speed", type=float, default=1.0, metavar="X",
                       help="run the clock X times as fast (0 freezes it); windows close sooner")
        t.add_argument("--insecure-seed", metavar="SEED",
                       help="deterministic noise from SEED (also env %s): NO PRIVACY, for tests only" % SEED_ENV)

    p = sub.add_parser("run", help="run the daemon with the configured event source",
                       description="Run the agent: read events from [source], release at every window/epoch "
                       "boundary of the UTC clock, publish the outbox in order. A finite source (stdin, file "
                       "with follow = false) releases what it counted at its end and exits once delivered. "
                       "SIGTERM saves the noisy state and exits.")
    common(p, 0.0)
    p.set_defaults(func=cmd_run)
    p = sub.add_parser("feed", help="count events from stdin, release at the end, wait for delivery",
                       description="Read events from standard input (one item per line, optional TAB and "
                       "integer weight), release at window/epoch boundaries and at end of input, wait until "
                       "the host has stored every release (its acknowledgement, not the broker's), exit 0. "
                       "Exit 1 if that takes longer than --timeout; nothing is lost, the releases stay in the "
                       "outbox and are re-sent by the next run or feed.")
    common(p, 60.0)
    p.add_argument("--jobs", "-j", type=_jobs, default=None, metavar="N",
                   help="count with N processes (cms/cs sketches): N - 1 helpers count input chunks on other "
                   "cores, each handed at most two chunks at a time, one counted and one waiting "
                   "(docs/PRIVACY.md); the releases are the same bytes (default: 2 with two or more CPUs, else 1)")
    p.add_argument("--no-flush", action="store_true",
                   help="at end of input do not release the open window early (it is released at its boundary "
                   "by the next run or feed): `feed --no-flush < /dev/null` only delivers the outbox. Without it "
                   "the end of input always releases, also with no events: skipping an empty window would make "
                   "the release depend on the data")
    p.set_defaults(func=lambda a: cmd_run(a, feed=True))
    p = sub.add_parser("check", help="validate a config, print the noise, guarantee and release size, try the broker",
                       description="Validate the config file, print the per-cell noise, the per-event guarantee "
                       "and the release size, and connect once to the broker with the configured TLS settings "
                       "and credentials (nothing is published), and to the local source broker of an mqtt source. "
                       "Exit 0 if all is well, 1 if a broker cannot "
                       "be reached or refuses the connection, 2 for a config error. Warns when the salt is an "
                       "example placeholder.")
    p.add_argument("--config", "-c", required=True, metavar="FILE")
    p.add_argument("--offline", action="store_true",
                   help="do not try the broker (e.g. ExecStartPre of a service that must start while the broker "
                   "is down)")
    p.add_argument("--timeout", type=float, default=5.0, metavar="SECONDS",
                   help="how long to wait for the broker (default %(default)s)")
    p.add_argument("--range-epochs", type=int, action="append", metavar="K",
                   help="range lengths (epochs) your queries use: compares window/keep and tree noise for them "
                        "(repeatable; default 1, 24, 168, 720, 10080)")
    p.add_argument("--levels", type=int, metavar="L", help="tree levels to compare with (default: the config's, or 8)")
    p.add_argument("--events", type=int, metavar="N",
                   help="expected events (dbits: distinct items) per release: print the expected interval width "
                        "and warn, with suggested d and w, when it will be uninformative")
    p.add_argument("--target-error", type=float, default=0.05, metavar="F",
                   help="relative half-width the suggestion aims at (default %(default)s)")
    p.set_defaults(func=cmd_check)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_CONFIG
    # numpy's OpenBLAS starts one thread per core when numpy is imported (agent/pi/bulknoise.py), which
    # costs about 60 ms of CPU on 2 cores (half of numpy's import); the daemon's numpy work is
    # elementwise integer arithmetic, never BLAS. An operator's own setting wins.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    from agent.pi.pipes import run_main

    def body() -> int:
        try:
            return int(args.func(args) or 0)
        except SystemExit as exc:
            return int(exc.code or 0)

    # `pansketch-agent check | head -1`: a closed stdout ends the command quietly (exit 141)
    return run_main(body)


def cli() -> None:
    """The command's entry point (``pansketch-agent``, ``python -m agent.pi.daemon``): :func:`main`,
    then an exit without the interpreter's teardown. Before ``main`` returns every file the agent
    wrote is fsynced and closed, the broker connection closed and the count workers reaped; tearing
    down numpy's and paho-mqtt's modules after that does nothing and cost 20-30 ms per run, a tenth
    of ``feed``'s time for a million lines. Output is flushed first; an exception still ends with
    its traceback and the normal exit. Tests call :func:`main`, which returns.

    The cyclic garbage collector is held off while the modules load (numpy's and paho-mqtt's
    imports made it run about 60 times, 6 ms, finding nothing to free); Agent.main turns it back on
    before counting."""
    global _GC_HELD
    _GC_HELD = True
    gc.disable()
    code = main()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: main() has already chosen the exit status
            pass
    os._exit(code)


if __name__ == "__main__":
    cli()
