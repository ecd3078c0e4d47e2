"""The aggregator service: MQTT releases -> validation -> store (SQLite or PostgreSQL); ``pansketch aggregate``.

:func:`run` connects the transport-free core (pansketch.host_tools.ingest.aggregator.Aggregator)
to a broker with paho-mqtt 2.x (``CallbackAPIVersion.VERSION2``, MQTT v5):

* subscribes ``[aggregator] topic`` (default ``pansketch/+/release``) at
  QoS 1, as the shared subscription ``$share/<group>/<topic>`` when
  ``shared_group`` is set, so several aggregators split the load;
* two processes, so that no CPU work competes with the writer for this
  process's GIL (docs/PERFORMANCE-HISTORY.md)::

      mosquitto ──▶ MQTT process ──batches: verdicts + payloads──▶ aggregator
                   (pansketch.host_tools.ingest.mqttproc: paho client,     │ validator thread: verdicts -> store items
                    validation under a CPU budget, reconnects)   │ writer thread: group commit ──▶ SQLite / PostgreSQL
                         ▲                                        │
                         └──── PUBACKs + host acks, after each commit

  the MQTT process validates each release as it arrives (a per-message
  CPU budget; a message that kills it is remembered, the process
  restarted, and the message refused as ``timeout`` when it killed it
  twice) and forwards it with its verdict; it sends what it is told; the
  validator thread turns verdicts into store items; the writer thread
  stores them as one group commit (one transaction; one bad message rolls
  back alone; pansketch.host_tools.store.write), which amortises the fsync over the
  group. With ``[broker] kind = "rabbitmq"`` the AMQP client runs in a
  thread of this process and validation in a helper process of its own
  (pansketch.host_tools.ingest.validproc), as before. If a helper process dies
  other than while validating a message, the aggregator stops with exit
  code 1 and says which (nothing committed is lost; what was not is
  redelivered); if the aggregator dies its helpers exit too;
* acknowledges a message only after its outcome is committed to the
  store (manual acks): a crash before the commit means the broker
  redelivers, and redelivery is harmless (idempotent store);
* after the commit, tells each device of the group, in one message per
  device: ``{"dev", "ok": [seq, ...]}`` on
  ``<prefix>/<device>/ack`` (QoS 1) for a stored release or a duplicate of
  one, ``{"dev", "bad": [[seq, code]]}`` for a release it will never store
  (docs/FORMAT.md section 7). The device deletes a release from its outbox
  only on that acknowledgement, so "delivered" means stored here;
* a persistent session (clean_start = False, session expiry
  ``session_expiry_s``) with a stable client id, so releases published
  while the aggregator is down wait in the broker; a shared-group member
  starts clean instead (session expiry 0 by default): its session, and
  its place in the group, end with its connection, so a member that dies
  does not keep taking its turn of the releases (mosquitto 2.0 hands
  offline members' sessions their share); what was in flight to it comes
  back as the devices' re-sends;
* TLS (CA, client certificate) and username/password from ``[broker]``;
  reconnects with capped exponential backoff (``reconnect_min_s`` ..
  ``reconnect_max_s``);
* ``until_idle``: exit 0 after that many seconds without a message
  (exit 1 if it never managed to connect); SIGINT/SIGTERM: store and
  acknowledge what was received, then exit 0 (the helpers ignore both
  signals and stop when told).

Hostile input (docs/HOST.md "Hostile input"): validation has a per-message
CPU budget in the process that validates (pansketch.host_tools.ingest.mqttproc, or
pansketch.host_tools.ingest.validproc for AMQP); refused messages are kept
bounded (pansketch.host_tools.store.Limits); a valid release from the future (beyond
``max_clock_skew_s``) or with a seq jump beyond ``max_seq_jump`` is
quarantined, not stored, and not acknowledged.

Output (stderr, ``logging``): a line per connection and when the
subscription is in place, one per stored release (device, seq, what it covers, size), warnings for
rejections (at most 10 per ``reject_log_interval_s``, then a summary line) and lost connections, a summary at exit; ``-q`` keeps only the
warnings and errors, ``-v`` adds the MQTT client's packet log.
"""


from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
import time
from typing import Any, Optional

from pansketch.agent.pi.tomlconf import placeholder_salt_warning
from pansketch.host_tools import hostconfig
from pansketch.host_tools.logsetup import setup_logging
from pansketch.host_tools.ingest import child
from pansketch.host_tools.ingest import devstatus
from pansketch.host_tools import metrics
from pansketch.host_tools.hostconfig import HostConfig
from pansketch.host_tools.ingest.aggregator import Aggregator
from pansketch.host_tools.ingest.mqttparent import MQTTProcess
from pansketch.host_tools.ingest.mqttshared import Msg, Settings
from pansketch.host_tools.ingest.pipeline import HELD_BYTES_MAX, RECEIVE_MAXIMUM, _Writer
from pansketch.host_tools.ingest.validproc import ValidatorDied, ValidatorProcess

log = logging.getLogger("pansketch.aggregator")


RETRIES_LINE = "store retries: "  # the exit line of retry counts (JSON after it); bench.pgscale reads it
FLAG_SCAN_S = 300.0  # how often the latest windows are compared for flagged devices


def signal_handler(signalled: list[int]) -> Any:
    """A SIGINT/SIGTERM handler that only records the signal. It runs in the main thread between two of its
    bytecodes; had it set the stop Event (``Event.set`` takes the Event's lock) while the main thread was
    inside that Event's ``wait`` holding the same lock, it would wait for itself: an aggregator told to
    stop (``systemctl stop``) then hung, every thread idle, until killed."""
    def handler(signum: int, _frame: Any) -> None:
        signalled.append(signum)

    return handler


def run(cfg: HostConfig, until_idle: Optional[float] = None, stop: Optional[threading.Event] = None,
        ready: Optional[threading.Event] = None, counts: Optional[dict[str, int]] = None) -> int:
    """Aggregate from the broker until stopped (SIGINT/SIGTERM, ``stop``) or idle.

    The MQTT client and validation run in helper processes
    (pansketch.host_tools.ingest.mqttproc, pansketch.host_tools.ingest.validproc); this process stores and
    decides every acknowledgement. ``ready`` is set once the subscription
    is acknowledged; ``counts``, if given, receives the numbers of
    stored/duplicate/rejected messages at exit. Returns an exit code (1
    also when a helper process dies).
    """
    stop = stop or threading.Event()
    agg = Aggregator(cfg)
    agg.store.background_checkpoints(drop_behind=cfg.aggregator.drop_cache_behind_mb << 20)
    # flagged devices: logged once per device and window; retention keeps their payloads
    agg.flag_scanner = metrics.FlagScanner(cfg.aggregator.db, log, FLAG_SCAN_S, max_events=cfg.fleet.max_events)
    agg.flag_scanner.start()
    cid = hostconfig.default_client_id(cfg)
    sub = cfg.aggregator.subscription
    state: dict[str, Any] = {"last": time.monotonic(), "connected": False, "ever": False, "fatal": None, "closing": False,
                             "fail_logged": -1e9}
    persistent = cfg.aggregator.session_expiry_s > 0 and (bool(cfg.broker.client_id) or not cfg.aggregator.shared_group)
    if persistent and cfg.aggregator.shared_group:
        # mosquitto 2.0 keeps handing an offline member's session its turn of the group's messages
        log.warning("shared_group %r with session_expiry_s = %d: if this aggregator dies, the broker keeps "
                    "giving its session a share of the releases for up to %d s (held there until the devices "
                    "re-send them, not lost); session_expiry_s = 0 (the default with a shared group) avoids it",
                    cfg.aggregator.shared_group, cfg.aggregator.session_expiry_s, cfg.aggregator.session_expiry_s)
    # releases (maybe a shared subscription) and every device's retained status
    # (never shared: each aggregator keeps its own copy; gap detection)
    # the MQTT process validates releases before it forwards them (pansketch.host_tools.ingest.mqttproc._Judge)
    settings = Settings(cfg.broker, cid, ((sub, cfg.aggregator.qos), (devstatus.status_filter(cfg), 1)), persistent,
                        cfg.aggregator.session_expiry_s, RECEIVE_MAXIMUM, verbose=log.isEnabledFor(logging.DEBUG),
                        validation=agg.validation)

    where = "%s:%d" % (cfg.broker.host, cfg.broker.port)  # for the log
    if cfg.broker.kind == "rabbitmq":
        where = "AMQP " + ", ".join("%s:%d" % n for n in cfg.broker.amqp_nodes)

    def fatal(why: str) -> None:
        state["fatal"] = why
        stop.set()

    def on_event(ev: tuple[Any, ...]) -> None:
        """Connection events of the MQTT process (its reader thread)."""
        kind = ev[0]
        if kind == "connected":
            state["connected"] = state["ever"] = True
            state["fail_logged"] = -1e9
            # the MQTT process says how many host acknowledgements it keeps in flight (the broker's Receive Maximum)
            log.info("connected to %s as %s; subscribing %s%s", where, cid, sub,
                     "" if len(ev) < 2 else " (host acknowledgements in flight: up to %d)" % ev[1])
        elif kind == "refused":
            log.error("broker %s refused the connection: %s", where, ev[1])
        elif kind == "subscribed" and ev[1] is not None:
            log.error("broker refused the subscription to %s: %s", sub, ev[1])
            fatal("subscription refused: %s" % ev[1])
        elif kind == "subscribed":
            state["last"] = time.monotonic()  # --until-idle counts from here: start-up is not idleness
            log.info("subscribed to %s (QoS %d%s); storing releases in %s", sub, cfg.aggregator.qos,
                     ", persistent session" if persistent else ", clean session", cfg.aggregator.db)
            if ready is not None:
                ready.set()
        elif kind == "connect_failed":
            now = time.monotonic()
            if now - state["fail_logged"] >= 60:  # once a minute while the broker stays unreachable
                state["fail_logged"] = now
                log.warning("cannot connect to broker %s; retrying (up to %g s apart)", where,
                            cfg.broker.reconnect_max_s)
        elif kind == "disconnected":
            state["connected"] = False
            if not stop.is_set() and not state["closing"]:
                log.warning("disconnected from broker (%s); reconnecting", ev[1])
        elif kind == "dropped":
            state["dropped"] = state.get("dropped", 0) + ev[1]
            now = time.monotonic()
            if now - state.get("drop_logged", -1e9) >= 60:  # once a minute while a flood lasts
                state["drop_logged"] = now
                log.warning("dropped %d QoS 0 messages (%d in all): more than %d were waiting for validation "
                            "(a QoS 0 flood? devices publish releases at QoS 1 and re-send them until "
                            "acknowledged)", ev[1], state["dropped"], ev[2])
        elif kind == "restarted":
            log.warning("MQTT process restarted (validating a message %s)", ev[1])
        elif kind == "exited":
            fatal("the MQTT process (pid %s) exited unexpectedly (%s)" % (transport.pid, child.exit_status(ev[1])))

    def on_messages(msgs: list[Msg]) -> None:
        state["last"] = time.monotonic()
        writer.put(msgs)

    transport: Any
    validator: Optional[ValidatorProcess] = None
    if cfg.broker.kind == "rabbitmq":  # a quorum queue over AMQP (host_tools/ingest/amqp.py)
        from pansketch.host_tools.ingest import amqp

        sub = "queue %s on %s" % (cfg.broker.queue, ", ".join("%s:%d" % n for n in cfg.broker.amqp_nodes))
        transport = amqp.AMQPTransport(amqp.Settings(cfg.broker, cfg.aggregator.topic, RECEIVE_MAXIMUM, cid),
                                       on_messages, on_event)
        # pika delivers in this process: validation in a helper process of its own (CPU budget there)
        validator = ValidatorProcess(agg.validation)
    else:
        transport = MQTTProcess(settings, on_messages, on_event)
    # SQLite: group commits return before their fsync, which the writer's syncer thread runs before any
    # acknowledgement (Store.defer_sync); PostgreSQL commits are durable when they return
    writer = _Writer(agg, validator, transport, stop, state, deferred=agg.store.defer_sync())
    old_handlers = {}
    signalled: list[int] = []  # set by the signal handler, turned into stop by the loop below
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            old_handlers[sig] = signal.signal(sig, signal_handler(signalled))
    warning = placeholder_salt_warning("fleet.salt", cfg.fleet.salt, "in every device's config")
    if warning:
        log.warning("%s", warning)
    cpu0 = time.process_time()
    try:
        if validator is not None:
            validator.start()
        writer.start()
        transport.start()
        start = time.monotonic()
        while not stop.is_set():
            time.sleep(0.05)  # not stop.wait: see signal_handler
            if signalled:
                stop.set()
                break
            try:
                if validator is not None:
                    validator.check()
            except ValidatorDied as exc:
                fatal(str(exc))
            if until_idle is not None and time.monotonic() - state["last"] > until_idle and writer.idle():
                break
        writer.drain(5.0)  # messages already received: store and acknowledge them before disconnecting
        if state["fatal"]:
            log.error("stopping: %s", state["fatal"])
            return 1
        if not state["ever"]:
            log.error("could not connect to broker %s within %.0f s", where,
                      time.monotonic() - start)
            return 1
        return 0
    finally:
        state["closing"] = True  # our own disconnect is not a lost connection
        # bounded, well below systemd's 30 s stop timeout: MQTT child <= 10 s, validation helper <= 2 s
        # (killed if busy: what it was validating is not acknowledged and comes again), threads <= 8 s
        transport.close()
        if validator is not None:
            validator.close()
        writer.close()
        agg.warnings.flush()
        for sig, h in old_handlers.items():
            signal.signal(sig, h)
        c = agg.counts
        guard: Any = validator if validator is not None else transport  # whichever process validated
        restarts, timeouts = getattr(guard, "restarts", 0), getattr(guard, "timeouts", 0)
        if counts is not None:
            counts.update(c)
        log.info("aggregator stopped: %d stored, %d duplicates, %d rejected, %d quarantined; %d group commit(s), "
                 "%.1f messages per group%s", c["stored"], c["duplicate"], c["rejected"], c["quarantined"],
                 writer.groups, writer.messages / max(1, writer.groups),
                 "; %s restarted %d time(s), %d timeout(s)"
                 % ("validation helper" if validator is not None else "MQTT process", restarts, timeouts)
                 if restarts else "")
        if writer.held.waits:
            log.info("received messages held here peaked at %.1f MB: the MQTT process waited %d time(s) for the "
                     "store to catch up (at most %d MB are held)", writer.held.peak / 1e6, writer.held.waits,
                     HELD_BYTES_MAX >> 20)
        summary = logging.getLogger("pansketch.aggregator.summary")  # one line at exit, also under -q
        summary.setLevel(logging.INFO)
        retries = dict(writer.retries)
        retries.update(("transaction %s" % k, v) for k, v in sorted(getattr(agg.store, "retry_counts", dict)().items()))
        summary.info("%s%s", RETRIES_LINE, json.dumps(retries, sort_keys=True))
        ck = getattr(agg.store, "checkpoints", None)
        if ck is not None:
            # (the soak benchmark reads it)
            summary.info("WAL checkpoints: %d completed, %d gave up (readers); %d pruned (retention); %d group "
                         "commit(s), %.1f messages per group", ck[1], ck[0], writer.pruned, writer.groups,
                         writer.messages / max(1, writer.groups))
        cpu = dict(writer.cpu)
        cpu["receive"] = getattr(transport, "cpu_s", 0.0)
        cpu["process_total"] = time.process_time() - cpu0  # all threads: the stages and the rest
        child.log_stage_cpu("aggregator", cpu, writer.messages)
        agg.flag_scanner.stop()
        agg.close()


# -- CLI ---------------------------------------------------------------------
def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("aggregate", help="subscribe to releases and store them",
                              description="Subscribe to device releases over MQTT, validate each one, store it "
                                          "idempotently in SQLite and log rejections (docs/HOST.md).")
    p.add_argument("--config", required=True, metavar="FILE", help="host config TOML")
    p.add_argument("--until-idle", type=float, metavar="SECONDS",
                   help="exit after this many seconds without a message")
    v = p.add_mutually_exclusive_group()
    v.add_argument("-v", "--verbose", action="store_true", help="also log the MQTT client's packets (debug)")
    v.add_argument("-q", "--quiet", action="store_true",
                   help="log only warnings and errors (rejections, lost connections), not each stored release")
    p.add_argument("--metrics-port", type=int, metavar="N",
                   help="serve Prometheus metrics on http://BIND:N/metrics (host_tools/metrics.py)")
    p.add_argument("--metrics-bind", default="127.0.0.1", metavar="ADDR", help="address for --metrics-port (127.0.0.1)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    cfg = hostconfig.load_for_command(args.config)
    if cfg is None:
        return 2
    if args.until_idle is not None and args.until_idle <= 0:
        print("pansketch aggregate: --until-idle must be positive", file=sys.stderr)
        return 2
    setup_logging(args.verbose, getattr(args, "quiet", False))
    exporter = None
    if getattr(args, "metrics_port", None) is not None:
        try:
            exporter = metrics.start_aggregator_exporter(cfg.aggregator.db, args.metrics_port, args.metrics_bind,
                                                         cfg.query.delta)
        except (ImportError, OSError) as exc:
            print("pansketch aggregate: --metrics-port: %s" % exc, file=sys.stderr)
            return 2
        log.info("metrics on http://%s:%d/metrics", *exporter.server.server_address[:2])
    try:
        return run(cfg, until_idle=args.until_idle)
    except Exception as exc:  # e.g. the database cannot be opened
        print("pansketch aggregate: %s" % exc, file=sys.stderr)
        return 1
    finally:
        if exporter is not None:
            exporter.close()
