"""``pansketch demo``: the whole system on embedded defaults, in well under a minute.

1. a broker: mosquitto on a free loopback port when it is installed,
   otherwise the pure-Python ``amqtt`` broker from PyPI (MQTT 3.1.1 only:
   the devices and the aggregator then speak 3.1.1);
2. the real aggregator (pansketch.host_tools.ingest.service.run, what ``pansketch
   aggregate`` runs: validation, store, host acknowledgements) into a
   temporary SQLite file;
3. several simulated agents: each is the real device core
   (pansketch.agent.recorder.Recorder with system-CSPRNG noise) plus the real
   publisher (pansketch.agent.pi.publisher.Publisher), driven by its own simulated clock
   so that one-hour windows close in milliseconds, and fed with a Zipf
   stream of "visited hosts";
4. a table of queries (pansketch.host_tools.query.core.freq): item, true count, estimate,
   interval, and whether the interval covers the truth.

The true counts are known only to this simulation (to print them next to
the estimates); the simulated devices never hold them.
"""

from __future__ import annotations

import argparse
import bisect
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from typing import Any, Callable, Optional

from pansketch.host_tools.localnet import Mosquitto, free_port, mosquitto_path

SALT = "pansketch-demo-fleet-salt"
T0 = 1_767_225_600  # 2026-01-01T00:00:00Z, a window boundary for every window length dividing a day


class DemoBroker:
    """A throw-away broker on 127.0.0.1:<free port>."""

    name = "?"
    protocol = 5  # MQTT version the clients use

    def __init__(self, workdir: str) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.connect_gate = threading.Lock()  # devices connect one at a time (_start)

    def stop(self) -> None:
        raise NotImplementedError


class MosquittoBroker(DemoBroker):
    def __init__(self, workdir: str, exe: str) -> None:
        DemoBroker.__init__(self, workdir)
        self.mosquitto = Mosquitto(workdir, self.port, "max_queued_messages 10000")
        try:
            v = subprocess.run([exe, "-h"], capture_output=True, timeout=5).stdout.decode().splitlines()[0]
        except Exception:
            v = "mosquitto"
        self.name = v.strip()

    def stop(self) -> None:
        self.mosquitto.stop()


class AmqttBroker(DemoBroker):
    """amqtt (pip install amqtt) in a background asyncio loop; MQTT 3.1.1."""

    protocol = 4

    def __init__(self, workdir: str) -> None:
        import asyncio
        import logging

        from amqtt.broker import Broker

        DemoBroker.__init__(self, workdir)
        logging.getLogger("amqtt").setLevel(logging.ERROR)
        logging.getLogger("transitions").setLevel(logging.ERROR)
        self.loop = asyncio.new_event_loop()
        config = {
            "listeners": {"default": {"type": "tcp", "bind": "127.0.0.1:%d" % self.port}},
            "sys_interval": 0,
            "auth": {"allow-anonymous": True, "plugins": ["auth_anonymous"]},
            "topic-check": {"enabled": False},
        }
        started = threading.Event()
        self.error: Optional[BaseException] = None

        def main() -> None:
            asyncio.set_event_loop(self.loop)
            try:
                self.broker = Broker(config, loop=self.loop)
                self.loop.run_until_complete(self.broker.start())
            except BaseException as exc:  # reported below
                self.error = exc
                started.set()
                return
            started.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=main, name="amqtt", daemon=True)
        self.thread.start()
        # Broker.start() returns once its listener is bound: no probe connection (amqtt logs a client that
        # connects and closes without a packet as an error, which the demo would print)
        if not started.wait(15) or self.error is not None:
            raise RuntimeError("amqtt broker did not start: %s" % (self.error or "no answer in 15 s",))
        try:
            from importlib.metadata import version

            self.name = "amqtt %s (MQTT 3.1.1)" % version("amqtt")
        except Exception:
            self.name = "amqtt (MQTT 3.1.1)"

    def stop(self) -> None:
        import asyncio

        try:
            fut = asyncio.run_coroutine_threadsafe(self.broker.shutdown(), self.loop)
            fut.result(10)
        except Exception:
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def start_broker(workdir: str, which: str) -> DemoBroker:
    exe = mosquitto_path()
    if which in ("auto", "mosquitto") and exe:
        return MosquittoBroker(workdir, exe)
    if which == "mosquitto":
        raise RuntimeError("mosquitto is not installed (apt-get install mosquitto)")
    try:
        return AmqttBroker(workdir)
    except ImportError:
        raise RuntimeError("no MQTT broker available: install mosquitto (apt-get install mosquitto) "
                           "or the Python broker (pip install 'pansketch[demo]', i.e. amqtt)")


class ZipfStream:
    """Items host-00001.example ... with P(rank k) proportional to k^-s (simulation only)."""

    def __init__(self, n: int, s: float, seed: int) -> None:
        self.items = ["host-%05d.example" % k for k in range(1, n + 1)]
        cum = []
        acc = 0.0
        for k in range(1, n + 1):
            acc += k ** -s
            cum.append(acc)
        self.cum = cum
        self.rng = random.Random(seed)

    def sample(self, m: int) -> list[str]:
        tot = self.cum[-1]
        r = self.rng.random
        items, cum = self.items, self.cum
        return [items[bisect.bisect_left(cum, r() * tot)] for _ in range(m)]


def _start(pub: Any, broker: DemoBroker) -> None:
    """Connect one device, the next only once the broker has granted this one's ack subscription. amqtt
    (the fallback broker) handles a connect by walking all its subscriptions with awaits in between; a
    SUBSCRIBE of another client arriving meanwhile ends that connection's handler on "dictionary changed
    size during iteration" and leaves a session that takes publishes and routes none (a demo agent then
    never hears from the host). One connect at a time keeps the walks apart."""
    with broker.connect_gate:
        pub.start()
        pub.wait_subscribed(10)  # without it (a slow broker) the device still delivers once subscribed


def _delivered(pub: Any, new_session: Callable[[], Any], broker: DemoBroker) -> bool:
    """Whether the host acknowledged every release of this device (stopping its publisher). A session
    that brought no acknowledgement of them in 15 s is replaced by a new connection once, for 30 s more:
    amqtt, the fallback broker, can lose a session on an internal error and keep taking its publishes
    without routing them, which re-sends on the same connection do not get past."""
    ok = pub.wait_delivered(15)
    pub.stop()
    if ok:
        return True
    pub = new_session()
    _start(pub, broker)
    ok = pub.wait_delivered(30)
    pub.stop()
    return bool(ok)


def simulate_agent(i: int, args: argparse.Namespace, workdir: str, broker: DemoBroker, truth: Counter,
                   truth_lock: threading.Lock, report: Callable[[str], None]) -> int:
    """One device: Recorder + Publisher on a simulated clock. Returns the number of releases."""
    from pansketch.agent.pi.config import BrokerConfig
    from pansketch.agent.params import Params
    from pansketch.agent.pi.publisher import Publisher
    from pansketch.agent.recorder import Recorder

    dev = "demo-pi-%d" % (i + 1)
    p = Params({"device": dev, "salt": SALT, "kind": args.kind, "d": args.d, "w": args.w, "mode": "window",
                "window_s": 3600, "mechanism": "dgauss", "budget": args.budget})
    rec = Recorder(p, os.path.join(workdir, dev), T0, log=lambda m: None)
    bcfg = BrokerConfig(host="127.0.0.1", port=broker.port, reconnect_min_s=1, reconnect_max_s=2,
                        ack_timeout_s=5.0)  # a release the host has not acknowledged is sent again well within the 30 s wait
    def new_session() -> Any:
        return Publisher(bcfg, dev, rec.outbox, lambda m: None, {"mode": "window"}, clock=lambda: T0,
                         protocol=broker.protocol)

    pub = new_session()
    _start(pub, broker)
    stream = ZipfStream(args.items, args.zipf, args.seed * 1000 + i)
    mine: Counter = Counter()
    slices = 6
    per = args.events // slices
    for k in range(args.windows):
        for j in range(slices):
            now = T0 + k * 3600 + j * (3600 // slices)
            if rec.tick(now):
                pub.wake()
            ev = stream.sample(per)
            rec.add_many(ev)
            mine.update(ev)
    if rec.tick(T0 + args.windows * 3600):
        pub.wake()
    with truth_lock:
        truth.update(mine)
    mine.clear()
    ok = _delivered(pub, new_session, broker)
    report("  %s: %d one-hour windows, %d events per window, %d releases -> %s"
           % (dev, args.windows, per * slices, rec.seq,
              "all stored by the host (its acknowledgements)" if ok else "NOT all delivered"))
    if not ok:
        raise RuntimeError("%s could not deliver its releases" % dev)
    return rec.seq


# One device of every other kind next to the cs fleet (every page and query has data after the
# demo). Each is the real device core (pansketch.agent.recorders.make picks the tree / dcs / dbits recorder) and
# the real publisher, like the cs agents; the events are drawn here, so their truth is known here only.
EXTRA_DEVICES: dict[str, dict[str, Any]] = {
    "cms": {"device": "demo-cms-1", "kind": "cms", "d": 4, "mode": "window", "window_s": 3600,
            "mechanism": "dgauss", "budget": "1/2"},
    "tree": {"device": "demo-tree-1", "kind": "cs", "d": 4, "mode": "tree", "epoch_s": 3600, "levels": 3,
             "mechanism": "dgauss", "budget": "1/2"},
    "dcs": {"device": "demo-temp-1", "kind": "dcs", "b": 12, "map": [10, 1, -40], "d": 4, "w": 256,
            "mode": "window", "window_s": 3600, "mechanism": "dgauss", "budget": "1/2"},
    "dbits": {"device": "demo-door-1", "kind": "dbits", "d": 12, "w": 256, "mode": "window", "window_s": 3600,
              "mechanism": "dlap", "budget": "1"},
    "strhh": {"device": "demo-words-1", "kind": "strhh", "len": 12, "d": 5, "w": 1024, "mode": "window",
              "window_s": 3600, "mechanism": "dgauss", "budget": "1/2"},
}
DCS_EVENTS = 3000  # readings per window of the dcs device (b + 1 levels per event: the slowest kind)
DBITS_DISTINCT = (150, 300, 450, 600)  # distinct door badges per window, cycled
STRHH_EVENTS = 20000  # strings per window of the strhh device (one level per byte: L counts per event)


def simulate_device(cfg: dict[str, Any], windows: int, sample: Callable[[int], list[str]], workdir: str,
                    broker: DemoBroker) -> int:
    """One device of any kind on a simulated clock, ``sample(k)`` = window k's events; returns its releases."""
    from pansketch.agent.pi.config import BrokerConfig
    from pansketch.agent.params import Params
    from pansketch.agent.pi.publisher import Publisher
    from pansketch.agent.recorders import make

    p = Params(dict(cfg, salt=SALT))
    dev = p.device
    rec = make(p, os.path.join(workdir, dev), T0, log=lambda m: None)
    bcfg = BrokerConfig(host="127.0.0.1", port=broker.port, reconnect_min_s=1, reconnect_max_s=2,
                        ack_timeout_s=5.0)  # a release the host has not acknowledged is sent again well within the 30 s wait
    def new_session() -> Any:
        return Publisher(bcfg, dev, rec.outbox, lambda m: None, {"mode": p.mode}, clock=lambda: T0,
                         protocol=broker.protocol)

    pub = new_session()
    _start(pub, broker)
    for k in range(windows):
        if rec.tick(T0 + k * 3600):
            pub.wake()
        rec.add_many(sample(k))
    if rec.tick(T0 + windows * 3600):
        pub.wake()
    ok = _delivered(pub, new_session, broker)
    if not ok:
        raise RuntimeError("%s could not deliver its releases" % dev)
    return int(rec.seq)


def _host_config(workdir: str, broker: DemoBroker, args: argparse.Namespace) -> Any:
    from pansketch.host_tools import hostconfig

    path = os.path.join(workdir, "host.toml")
    with open(path, "w") as f:
        f.write('[broker]\nhost = "127.0.0.1"\nport = %d\nmqtt_version = "%s"\nclient_id = "demo-aggregator"\n'
                'reconnect_min_s = 1\nreconnect_max_s = 2\n\n[aggregator]\ndb = "demo.db"\n\n'
                "# no kind/d/w here: the demo fleet mixes kinds (cs, cms, dcs, dbits) and modes\n"
                '[fleet]\nsalt = "%s"\n\n'
                "# the demo replays windows from %s: by the wall clock every release arrives\n"
                "# long after its window ended, so 'late' (pansketch status) would flag all of them\n"
                "[status]\nlate_grace_s = %d\n"
                % (broker.port, "5" if broker.protocol == 5 else "3.1.1", SALT,
                   time.strftime("%Y-%m-%d", time.gmtime(T0)), 10 * 365 * 86400))
    return hostconfig.load(path)


def run_demo(args: argparse.Namespace) -> int:
    from pansketch.host_tools.ingest import service
    from pansketch.host_tools.query import core as query
    from pansketch.host_tools.store.backend import open_store as Store

    if args.serve:  # before the fleet runs: its dashboard would need the web extra only at the end
        from pansketch.host_tools.web.extra import missing_web

        why = missing_web()
        if why:
            print("pansketch demo: --serve %s" % why, file=sys.stderr)
            return 2
    t_start = time.monotonic()
    out = sys.stdout

    def say(msg: str) -> None:
        out.write(msg + "\n")
        out.flush()

    workdir = args.dir or tempfile.mkdtemp(prefix="pansketch-demo-")
    os.makedirs(workdir, exist_ok=True)
    say("pansketch demo: %d agents x %d windows x %d Zipf(%.2g) events over %d items; %s sketch d=%d w=%d, "
        "discrete Gaussian, rho = %s per event (work dir %s)"
        % (args.agents, args.windows, args.events, args.zipf, args.items, args.kind, args.d, args.w,
           args.budget, workdir))
    broker: Optional[DemoBroker] = None
    stop = threading.Event()
    agg_thread: Optional[threading.Thread] = None
    code = 1
    try:
        say("[1/5] broker ...")
        broker = start_broker(workdir, args.broker)
        say("      %s listening on 127.0.0.1:%d" % (broker.name, broker.port))

        say("[2/5] aggregator ...")
        os.environ["PANSKETCH_STAGE_CPU"] = "0"  # its helpers' CPU-per-stage lines are for the benchmarks
        cfg = _host_config(workdir, broker, args)
        # the production aggregator whatever the broker (validation, store, host acknowledgements), speaking
        # the MQTT version the broker knows ([broker] mqtt_version in the host.toml written above)
        ready = threading.Event()
        rc_box: list[int] = []
        agg_thread = threading.Thread(target=lambda: rc_box.append(service.run(cfg, stop=stop, ready=ready)),
                                      name="aggregator", daemon=True)
        agg_thread.start()
        if not ready.wait(15):
            raise RuntimeError("the aggregator did not subscribe")
        say("      subscribed to %s, storing into %s" % (cfg.aggregator.topic, cfg.aggregator.db))

        say("[3/5] agents (simulated clocks, real noise, real MQTT) ...")
        truth: Counter = Counter()
        lock = threading.Lock()
        results: list[Any] = [None] * args.agents
        errors: list[BaseException] = []

        def agent_main(i: int) -> None:
            try:
                results[i] = simulate_agent(i, args, workdir, broker, truth, lock, say)  # type: ignore[arg-type]
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=agent_main, args=(i,), name="agent-%d" % i) for i in range(args.agents)]
        extra = _extra_streams(args)
        n_extra: dict[str, int] = {}

        def extra_main(kind: str) -> None:
            try:
                cfg = dict(EXTRA_DEVICES[kind], **({"w": args.w} if kind in ("cms", "tree") else {}))
                n_extra[kind] = simulate_device(cfg, args.windows, extra[kind].sample, workdir, broker)  # type: ignore[arg-type]
            except BaseException as exc:
                errors.append(exc)

        if not args.cs_only:
            threads += [threading.Thread(target=extra_main, args=(k,), name="demo-" + k) for k in EXTRA_DEVICES]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        expected = sum(results) + sum(n_extra.values())
        if not args.cs_only:
            truth.update(extra["tree"].truth)  # the tree-mode device is cs with the fleet's d, w: it merges
            say("  %s: one device of each other kind (cms, tree mode, dcs readings, dbits, strhh strings), %d releases"
                % (", ".join(EXTRA_DEVICES[k]["device"] for k in EXTRA_DEVICES), sum(n_extra.values())))

        say("[4/5] waiting for the aggregator to store %d releases ..." % expected)
        deadline = time.monotonic() + 30
        with Store(cfg.aggregator.db, readonly=True) as st:
            while st.release_count() < expected and time.monotonic() < deadline:
                time.sleep(0.05)
            n, nrej, ndup, _ = st.snapshot()
            sizes = {len(st.payload(r.device, r.elo, r.ehi, r.part) or b"") for r in st.releases()
                     if r.device.startswith("demo-pi-")}
        say("      stored %d releases (%d rejected, %d duplicates)" % (n, nrej, ndup))
        if n != expected:
            raise RuntimeError("only %d of %d releases were stored" % (n, expected))

        say("[5/5] queries over all devices and windows (pansketch.host_tools.query.core.freq, %d%% intervals):"
            % round(args.confidence * 100))
        ranked = [x for x, _ in truth.most_common()]
        picks = ranked[:8] + [ranked[r] for r in (19, 49, 99, 499) if r < len(ranked)]
        unseen = "never-seen.example"
        picks.append(unseen)
        with Store(cfg.aggregator.db, readonly=True) as st:
            t_q = time.perf_counter()
            answers = query.freq(st, picks, salt=SALT, confidence=args.confidence)
            t_q = time.perf_counter() - t_q
            top = query.topk(st, ZipfStream(args.items, args.zipf, 0).items, 5, salt=SALT,
                             confidence=args.confidence)
        covered = 0
        say("")
        say("  %-20s %8s %10s   %-22s %s" % ("item", "true", "estimate", "interval", "covered"))
        say("  %s" % ("-" * 72))
        for a in answers:
            true = truth.get(a.item, 0)
            inside = a.lo <= true <= a.hi
            covered += inside
            say("  %-20s %8d %10.0f   [%8.0f, %8.0f]   %s" % (a.item, true, a.estimate, a.lo, a.hi,
                                                           "yes" if inside else "NO"))
        say("")
        a0 = answers[0]
        say("  %d of %d true counts inside their intervals; %d releases from %d devices merged, "
            "noise sd per merged cell %.1f, query time %.1f ms"
            % (covered, len(answers), a0.releases, len(a0.devices), a0.noise_sd, t_q * 1000))
        true_top = ranked[:5]
        say("  top-5 by query.topk over %d candidates: %s (true top-5: %s)"
            % (args.items, ", ".join(str(a.item) for a in top),
               "same" if [a.item for a in top] == true_top else ", ".join(true_top)))
        say("  release size of demo-pi-*: %s bytes (d=%d, w=%d: fixed, whatever the data); total %.1f s"
            % ("/".join(str(x) for x in sorted(sizes)), args.d, args.w, time.monotonic() - t_start))
        if not args.cs_only:
            say("")
            with Store(cfg.aggregator.db, readonly=True) as st:
                lines = kind_lines(st, args, extra, ranked[0])
            lines.insert(1, "  cs     %-12s the table above: %d of %d true counts inside their intervals"
                         % ("demo-pi-1..%d" % args.agents, covered, len(answers)))
            for line in lines:
                say(line)
        say("")
        say("  try it yourself: pansketch query --config %s freq %s" % (os.path.join(workdir, "host.toml"), ranked[0])
            if args.dir else "  (run with --dir DIR to keep the broker config, database and outboxes)")
        code = 0
    except Exception as exc:
        print("pansketch demo: FAILED: %s" % exc, file=sys.stderr)
        code = 1
    finally:
        stop.set()
        if agg_thread is not None:
            agg_thread.join(10)
        if broker is not None:
            broker.stop()
        if code == 0:
            code = dashboard(args, workdir, say)
        if not args.dir:
            shutil.rmtree(workdir, ignore_errors=True)
    return code


class ExtraStream:
    """The events of one extra device, window by window, and their truth (simulation only)."""

    def __init__(self, draw: Callable[[int], list[str]]) -> None:
        self.draw = draw
        self.truth: Counter = Counter()
        self.per_window: list[list[str]] = []

    def sample(self, k: int) -> list[str]:
        ev = self.draw(k)
        self.truth.update(ev)
        self.per_window.append(ev)
        return ev


def _extra_streams(args: argparse.Namespace) -> dict[str, ExtraStream]:
    cms = ZipfStream(args.items, args.zipf, args.seed * 1000 + 101)
    tree = ZipfStream(args.items, args.zipf, args.seed * 1000 + 102)
    temps = random.Random(args.seed * 1000 + 103)
    words = ZipfStream(args.items, args.zipf, args.seed * 1000 + 104)  # strhh finds these with no candidate list

    def readings(k: int) -> list[str]:  # a room warming up through the day, 0.1 degree sensor
        return ["%.1f" % temps.gauss(19.5 + 1.5 * k, 1.2) for _ in range(min(args.events, DCS_EVENTS))]

    def badges(k: int) -> list[str]:
        n = DBITS_DISTINCT[k % len(DBITS_DISTINCT)]
        return ["badge-%04d" % (j % n) for j in range(max(n, min(args.events, 4 * n)))]

    return {"cms": ExtraStream(lambda k: cms.sample(args.events)),
            "tree": ExtraStream(lambda k: tree.sample(args.events)),
            "dcs": ExtraStream(readings), "dbits": ExtraStream(badges),
            "strhh": ExtraStream(lambda k: [x[:-8] for x in words.sample(STRHH_EVENTS)])}  # host-00001: 10 bytes


def kind_lines(st: Any, args: argparse.Namespace, extra: dict[str, ExtraStream], top: str) -> list[str]:
    """One short line per kind and mode: what a query of that kind answers on the demo store."""
    from pansketch.host_tools.query import core as query
    from pansketch.host_tools.query import distinct, dyadic_cli, strheavy_cli

    conf, span = args.confidence, args.windows * 3600
    out = ["  one line per kind (%d%% intervals; true values known to the simulation only):" % round(conf * 100)]
    dev = EXTRA_DEVICES["cms"]["device"]
    (a,) = query.freq(st, [top], salt=SALT, device=dev, confidence=conf)
    out.append("  cms    %-12s freq %s = %s [%s, %s], true %d" % (dev, top, query._fmt(a.estimate), query._fmt(a.lo),
                                                                 query._fmt(a.hi), extra["cms"].truth[top]))
    dev = EXTRA_DEVICES["tree"]["device"]
    (a,) = query.freq(st, [top], salt=SALT, device=dev, since=T0, until=T0 + span, confidence=conf)
    out.append("  tree   %-12s %s over %d h from %d dyadic node(s) = %s [%s, %s], true %d"
               % (dev, top, args.windows, a.extra.get("tree_nodes", 0), query._fmt(a.estimate), query._fmt(a.lo),
                  query._fmt(a.hi), extra["tree"].truth[top]))
    dev = EXTRA_DEVICES["dcs"]["device"]
    (q,) = dyadic_cli.quantiles(st, [0.5], salt=SALT, device=dev, confidence=conf)
    vals = sorted(float(x) for x in extra["dcs"].truth.elements())
    # the interval is for the rank of the reading found (events at or below it), so the truth to hold it
    # against is that reading's true rank, beside the true median; the demo's readings are whole tenths,
    # so the middle of the reading range splits them without float edge effects
    mid = (float(q["reading"][0]) + float(q["reading"][1])) / 2
    true_rank = sum(1 for x in vals if x < mid)
    out.append("  dcs    %-12s median in [%s, %s) (true %.1f); readings at or below it of %d: %s [%s, %s], true %d"
               % (dev, dyadic_cli._fmt(q["reading"][0]), dyadic_cli._fmt(q["reading"][1]), vals[len(vals) // 2],
                  len(vals), dyadic_cli._fmt(q["rank"]), dyadic_cli._fmt(round(q["rank_lo"])),
                  dyadic_cli._fmt(round(q["rank_hi"])), true_rank))
    dev = EXTRA_DEVICES["dbits"]["device"]
    d = distinct.query(st, salt=SALT, device=dev, confidence=conf)
    out.append("  dbits  %-12s distinct badges = %s [%s, %s] (sum over %d windows), true %d"
               % (dev, dyadic_cli._fmt(d["estimate"]), dyadic_cli._fmt(d["lo"]), dyadic_cli._fmt(d["hi"]),
                  args.windows, sum(len(set(w)) for w in extra["dbits"].per_window)))
    dev = EXTRA_DEVICES["strhh"]["device"]
    rows = strheavy_cli.heavy(st, 3, salt=SALT, device=dev, confidence=conf)
    truth = extra["strhh"].truth.most_common(3)
    found = sum(1 for r in rows if r["item"] in dict(truth))
    out.append("  strhh  %-12s top-3 strings found with no candidate list (%d reported) = %d, true %d"
               % (dev, len(rows), found, len(truth)))
    return out


def dashboard(args: argparse.Namespace, workdir: str, say: Callable[[str], None]) -> int:
    """End of the demo: the dashboard URL, and with ``--serve`` the dashboard itself until Ctrl-C."""
    cands = os.path.join(workdir, "candidates.txt")
    with open(cands, "w") as f:
        f.write("\n".join(ZipfStream(args.items, args.zipf, 0).items) + "\n")
    conf = os.path.join(workdir, "host.toml")
    url = "http://%s:%d/" % (args.bind if ":" not in args.bind else "[%s]" % args.bind, args.port)
    if not args.serve:
        if args.dir:
            say("  dashboard: pansketch serve --config %s --candidates %s --port %d, then %s"
                % (conf, cands, args.port, url))
        else:  # nothing serves, and the store goes away with the work dir: do not suggest otherwise
            say("  dashboard: not running (this demo's files are removed now); `pansketch demo --serve` keeps "
                "one at %s until Ctrl-C" % url)
        return 0
    from pansketch.host_tools.web.serve import is_loopback

    if not is_loopback(args.bind):
        say("pansketch demo: --serve binds loopback addresses only (use pansketch serve --token elsewhere)")
        return 2
    try:
        from pansketch.host_tools import hostconfig
        from pansketch.host_tools.web.serve import make_server, run_until_stopped, server_url
        from pansketch.host_tools.web.app import Dashboard

        from pansketch.host_tools.web.app import allowed_hosts_for

        app = Dashboard(hostconfig.load(conf), candidates=ZipfStream(args.items, args.zipf, 0).items,
                        candidates_name="the demo's %d items" % args.items, allowed_hosts=allowed_hosts_for(args.bind))
        try:
            server = make_server(app, args.bind, args.port)
        except OSError as exc:
            if args.port == 0:
                raise
            say("  port %d is busy (%s); using a free one" % (args.port, exc))
            server = make_server(app, args.bind, 0)
    except ImportError as exc:
        say("pansketch demo: --serve needs the web extra (pip install 'pansketch[web]'): %s" % exc)
        return 2
    url = server_url(server)
    say("  item over time: %sitem?item=host-00001.example&item=host-00020.example&item=never-seen.example" % url)
    say("  dashboard: %s  (serving until Ctrl-C)" % url)
    run_until_stopped(server, sigterm=True)
    return 0


def add_parser(subparsers: Any) -> None:
    from pansketch.host_tools.query.core import positive_int

    p = subparsers.add_parser(
        "demo", help="run broker, simulated agents, aggregator and queries on embedded defaults",
        description="Whole system in well under a minute: a local broker (mosquitto if installed, else the "
        "Python broker amqtt), the aggregator into a temporary SQLite file, several simulated agents (the real "
        "device core and publisher on fast simulated clocks, Zipf event streams), then a table of estimates with "
        "intervals next to the true counts.")
    p.add_argument("--agents", type=positive_int, default=4, help="simulated devices (default %(default)s)")
    p.add_argument("--windows", type=positive_int, default=3, help="one-hour windows per device (default %(default)s)")
    p.add_argument("--events", type=positive_int, default=30000, help="events per device and window (default %(default)s)")
    p.add_argument("--items", type=positive_int, default=10000, help="distinct items in the Zipf universe (default %(default)s)")
    p.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent (default %(default)s)")
    p.add_argument("--kind", choices=("cs", "cms"), default="cs", help="sketch kind (default %(default)s)")
    p.add_argument("--d", type=positive_int, default=4, help="rows (default %(default)s)")
    p.add_argument("--w", type=positive_int, default=2048, help="columns (default %(default)s)")
    p.add_argument("--budget", default="1/2", help="rho per event, as a fraction (default %(default)s)")
    p.add_argument("--confidence", type=float, default=0.95, help="interval confidence (default %(default)s)")
    p.add_argument("--cs-only", action="store_true",
                   help="only the cs fleet (no cms, tree-mode, dcs, dbits and strhh device)")
    p.add_argument("--seed", type=int, default=1, help="seed of the simulated event streams (not of the noise)")
    p.add_argument("--broker", choices=("auto", "mosquitto", "amqtt"), default="auto",
                   help="which broker to start (default: mosquitto if installed, else amqtt)")
    p.add_argument("--dir", metavar="DIR", help="keep all files (configs, database, outboxes) in DIR")
    p.add_argument("--serve", action="store_true",
                   help="keep serving the dashboard (pansketch serve) on the demo's store until Ctrl-C")
    p.add_argument("--bind", default="127.0.0.1", metavar="ADDR", help="dashboard address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="dashboard port (default 8080; busy: any free port)")
    p.set_defaults(func=run_demo)
