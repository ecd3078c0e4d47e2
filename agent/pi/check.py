"""``pansketch-agent check``: validate a config, print the noise, the guarantee and the
release size, and try the broker once (nothing is published)."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from pansketch.agent.pi.common import EXIT_OK, EXIT_UNDELIVERED, die, load_config


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
    from pansketch.agent import calibrate, release
    from pansketch.agent.sketch import new_counters
    from pansketch.agent.pi.tomlconf import placeholder_salt_warning

    cfg = load_config(args.config)
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
    if p.kind == "strhh":  # the memory it takes and the noise a node estimate carries
        import math

        def _var(spec):
            t = spec.num / spec.den
            return t if spec.mech == "dgauss" else 2 * math.exp(-1 / t) / (1 - math.exp(-1 / t)) ** 2

        sd = ((_var(p.noise) + _var(p.inoise)) / p.d) ** 0.5
        print("strhh       len=%d prefix levels (one event updates all), %d bytes per counter array, %d arrays in RAM"
              " (boards: python -m pansketch.firmware.memory --config pansketch.json says which w fits)"
              % (p.b, 4 * p.cells, 3 if p.shadow else 2))
        print("  error     noise sd of a node estimate (about that of the mean of d cells: internal + output draw): %.0f "
              "events per device window; a string holding 2%% of 10^5 events (2000) is %.0f sd above it"
              % (sd, 2000 / sd))
        print("  boards    python -m pansketch.firmware.memory --config pansketch.json: which len, d, w fit each board, the"
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
    from pansketch.agent.pi import plan

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
    from pansketch.agent.pi.memwipe import swap_devices

    swaps = swap_devices()
    print("swap        %s" % ("on: " + ", ".join(swaps) if swaps else "off (or RAM only: zram)"))
    sys.stdout.flush()
    if warning:
        die(0, "WARNING: " + warning)
    if swaps:  # docs/PRIVACY.md "Memory residue": what is swapped out outlives every wipe in RAM
        die(0, "WARNING: swap is on (%s): pages of the agent written there (raw events, noise being added) stay "
            "on that disk after they are wiped in RAM; turn swap off on the device (e.g. `sudo dphys-swapfile "
            "swapoff && sudo systemctl disable dphys-swapfile` on Raspberry Pi OS) or use zram" % ", ".join(swaps))
    if source_failed:
        die(0, "cannot reach the local source broker %s:%d: the agent would count no events until it answers"
             % (cfg.source.host, cfg.source.port))
    if code != EXIT_OK and not (source_failed and ok_main):
        die(0, "cannot reach the broker (the config itself is valid; the agent would count and keep its releases "
                "in the outbox until it can); --offline skips this test")
    return code
