"""The board application: boot, main-loop step, safe idle state.

``main()`` is what the board's ``/main.py`` runs::

    boot(config)  ->  App   (config valid, sketch allocated, watchdog armed)
                  ->  Idle  (anything that makes running pointless or unsafe:
                             bad config, no CSPRNG, sketch too big, state of
                             other parameters; prints why every 30 s, never
                             arms the watchdog, so it is not a crash loop and
                             the REPL stays reachable for mpremote)

``App.step()`` is one main-loop iteration (tests call it step by step):

1. feed the watchdog;
2. take at most ``max_events_per_step`` events from the source into the
   noisy sketch (``pansketch.agent.recorder.Recorder``, unchanged device core);
3. time: before the first NTP answer the board counts but does not release
   (it says so every minute) and persists its noisy state every
   ``persist_s`` of uptime; once synced, ``Recorder.tick(now)`` commits a
   release at every epoch end, after persisting the state first so that a
   power cut during the commit loses no event;
4. network: WiFi (backoff), then the broker (backoff): status, then at most
   one release from the outbox per step, oldest first, acked only after its
   PUBACK (firmware/mqtt.py).

Which ``now`` before the clock is synced: the Recorder is created at boot
with the RTC's time, which after a power cut is 2000/2021 (invalid). Its
open accumulator is re-dated at the first sync (:meth:`App._dated`):

* opened by an invalid clock -> it covers [epoch of this boot, current
  epoch] (events counted since boot happened in that span);
* resumed from flash with a valid range [elo, ehi) -> its end is extended
  to the current epoch, because events counted since boot are in it too.

So a release's [elo, ehi) always covers the time its events happened, and
the release time depends only on the clock, never on the events. After a
reboot the first release can therefore span more than one epoch.

Memory discipline: the Recorder (two d*w int32 arrays) is allocated first,
right after the imports, before WiFi and TLS fragment the heap; per event
the only allocation is the item and its SHA-256 (GPIO counting allocates
nothing); releases are streamed from flash. ``MemoryError`` while running
drops the broker connection (freeing the TLS buffers), collects, and
retries later; counting goes on. Full flash: the Recorder keeps counting
and releases a longer epoch range once space is back (agent/recorder.py);
the app logs it and the outbox drains when the broker is reachable. A
persist or commit that fails in any way (ENOSPC, EIO, MemoryError) counts
as written: the Recorder adds the fresh draw it would add after a good
write, so the next try waits persist_s like any persist
(docs/PRIVACY.md "Failed writes").
"""

import gc
import sys

from pansketch.agent import hashing, storage, wipe
from pansketch.agent.recorders import make as make_recorder
from pansketch.agent.rng import DeterministicSource, NoEntropyError, Rng, SystemSource
from pansketch.firmware import clock, config
from pansketch.firmware.clock import MIN_VALID_UNIX

VERSION = "0.1.0"
# warnings whose mute time would tell when an event arrived (kept only while muted)
EVENT_WARNINGS = ("drop", "srcdrop", "lowmem")


def log(msg):
    print("pansketch: " + msg)


class StartError(Exception):
    pass


class Watchdog:
    """``machine.WDT`` once armed; before that (and with watchdog_s = 0) a no-op."""

    def __init__(self, timeout_s):
        self.timeout_ms = timeout_s * 1000
        self.wdt = None

    def arm(self):
        if not self.timeout_ms or self.wdt is not None:
            return
        import machine

        t = self.timeout_ms
        try:
            self.wdt = machine.WDT(timeout=t)
        except TypeError:  # ESP8266: fixed hardware timeout
            self.wdt = machine.WDT()
        except ValueError:  # RP2040: at most 8388 ms
            self.wdt = machine.WDT(timeout=8000)
            log("watchdog: %d ms is too long for this port, using 8000 ms" % t)

    def feed(self):
        if self.wdt is not None:
            self.wdt.feed()


class _FeedingSource:
    """Byte source wrapper: feeds the watchdog while noise is being drawn.

    Drawing the noise of a d*w array takes 2*d*w samples at an epoch end
    (seconds on a board); the Rng reads its bytes in 64-byte chunks, so the
    watchdog is fed all along without touching the device core.
    """

    def __init__(self, src, feed):
        self.src = src
        self.feed = feed
        self.fresh = getattr(src, "fresh", False)  # the Rng wipes what read returns (agent/wipe.py)

    def read(self, n):
        self.feed()
        return self.src.read(n)


class Idle:
    """Safe idle state: explain, wait, never arm the watchdog."""

    running = False

    def __init__(self, reason):
        self.reason = reason
        self.next_ms = 0
        self.clock = clock.Clock()
        log("NOT RUNNING: " + reason)

    def step(self):
        up = self.clock.uptime_ms()
        if up >= self.next_ms:
            self.next_ms = up + 30000
            log("idle: %s -- fix it (mpremote), then reset the board" % self.reason)
        return 1000


class App:
    running = True

    def __init__(self, cfg, rng=None):
        self.cfg = cfg
        self.p = cfg.params
        # The radio goes on BEFORE any random byte is read (SystemSource's
        # self-test, the Recorder's internal noise): Espressif documents that
        # esp_random(), behind os.urandom on the ESP32, yields true random
        # numbers only while WiFi or Bluetooth is enabled (RF noise feeds the
        # hardware RNG), and is pseudo-random otherwise. See docs/FIRMWARE.md.
        from pansketch.firmware import wifi

        self.wlan = wifi.activate(cfg.wifi_hostname)
        self.clock = clock.Clock()
        self.wdt = Watchdog(cfg.watchdog_s)
        self.insecure = False
        if rng is None:
            if cfg.insecure_rng_seed is not None:
                src = DeterministicSource(cfg.insecure_rng_seed)
                self.insecure = True
                for _ in range(3):
                    log("WARNING: insecure_rng_seed is set: noise is PREDICTABLE, releases are NOT private. "
                        "Tests only: remove it from the config.")
            else:
                try:
                    src = SystemSource()
                except NoEntropyError as exc:
                    raise StartError("no cryptographic random source on this board (%s); refusing to count" % exc)
            rng = Rng(_FeedingSource(src, self.wdt.feed))
        self.rng = rng
        gc.collect()
        n = self.p.cells
        try:
            boot_now = self.clock.provisional()
            self.rec = make_recorder(self.p, cfg.state_dir, boot_now, rng=rng, log=log, outbox_max=cfg.outbox_max)
            # Opened fresh (not resumed from state.bin) under an unset
            # clock: after a release the core dates it from that release's range (a
            # clock behind the last release never reuses a key), so _dated must not
            # take its range as real.
            self.opened_unset = boot_now < MIN_VALID_UNIX and not self.rec.resumed
        except MemoryError:
            gc.collect()
            raise StartError("out of memory allocating the sketch: d*w = %d cells need about %d bytes of heap "
                             "(%d free after collect); lower sketch.w%s (python -m pansketch.firmware.memory --config ... "
                             "prints what fits)" % (n, _cell_bytes(self.p) * n, gc.mem_free(),
                                                    " or set sketch.persist_noise = \"refresh\" (one array less)"
                                                    if self.p.shadow else ""))
        except storage.StateError as exc:
            raise StartError("%s. Pending releases are in %s/outbox." % (exc, cfg.state_dir))
        except OSError as exc:
            raise StartError("cannot use state directory %s: %s" % (cfg.state_dir, exc))
        gc.collect()
        from pansketch.firmware import mqtt, sources

        try:
            self.source = sources.load(cfg.source_type, cfg.source, log)
        except Exception as exc:  # e.g. a pin or UART this board does not have
            raise StartError("source %r cannot start: %r (check the \"source\" settings)" % (cfg.source_type, exc))
        self.wifi = wifi.Wifi(cfg.wifi_ssid, cfg.wifi_password, log, cfg.wifi_hostname,
                              cfg.wifi_timeout_s, cfg.wifi_retry_max_s, wlan=self.wlan)
        self.link = mqtt.Link(cfg, log, self.wdt.feed)
        self._mqtt = mqtt
        self.ntp_next = 0
        self.ntp_delay = 5000
        self.last_persist = 0
        self.due_up = 0  # uptime (ms) of the next Recorder.tick: idle steps do no clock arithmetic
        self.outbox_hint = True  # the outbox may have releases (saves a listdir per step)
        self.warned = {}  # kind -> uptime (ms) until which that warning is muted
        # kinds cs and cms hash a source's buffer where it lies (Sketch.update_view); the others
        # get item objects (freed, then scrubbed with the rest of the heap at the step's end)
        self._byview = self.rec.add_view if hasattr(self.rec.sketch, "update_view") else None
        # No event or drop counters, no step counter, no time of the last event
        # anywhere: memory is readable by an intruder (docs/ARCHITECTURE.md), so the app
        # keeps nothing but the noisy sketch. Mutes of event-triggered warnings
        # are forgotten once they expire (see _expire_mutes).
        try:
            self.source.start(self)
        except Exception as exc:
            raise StartError("source %r cannot start: %r (check the \"source\" settings)" % (cfg.source_type, exc))
        self.wdt.arm()
        wipe.heap()  # the internal noise's random bytes and the samplers' frames
        log("running: device %s, %s %dx%d %s mode, epoch %d s; state in %s" % (
            self.p.device, self.p.kind, self.p.d, self.p.w, self.p.mode, self.p.epoch_s, cfg.state_dir))

    # -- sink API for sources ----------------------------------------------
    def add(self, item, weight=1):
        try:
            self.rec.add(item, weight)
        except MemoryError:
            gc.collect()
            try:
                self.rec.add(item, weight)
            except MemoryError:
                self._drop("low memory")
        except (TypeError, ValueError) as exc:  # an item of the wrong type
            self._drop("%s" % exc)

    def add_view(self, text, view, weight=1):
        """One event whose item is the bytes in ``view``, a memoryview of the source's
        preallocated buffer (``text``: UTF-8 the source has checked, counted as a str item;
        else a bytes item). The source wipes its buffer afterwards."""
        try:
            self._add_view(text, view, weight)
        except MemoryError:
            gc.collect()
            try:
                self._add_view(text, view, weight)
            except MemoryError:
                self._drop("low memory")
        except (TypeError, ValueError) as exc:
            self._drop("%s" % exc)

    def _add_view(self, text, view, weight):
        if self._byview is not None:
            self._byview(text, view, weight)
            return
        raw = bytes(view)
        self.rec.add(str(raw, "utf-8") if text else raw, weight)

    def prepare(self, item):
        return hashing.digest(self.rec.sketch.prefix, item, self.p.d)

    def add_prepared(self, handle, count):
        self.rec.sketch.add_stream(handle, count)  # wraps mod 2^32, never refuses

    def _drop(self, why):
        self.warn("drop", "an event was not counted (%s)" % why)

    def warn(self, kind, msg, every_ms=60000):
        up = self.clock.uptime_ms()
        until = self.warned.get(kind)
        if until is None or up >= until:
            self.warned[kind] = up + every_ms
            log(msg)

    def _expire_mutes(self, up):
        """Drop expired mutes of warnings that events trigger (their time would date an event)."""
        w = self.warned
        for kind in EVENT_WARNINGS:
            until = w.get(kind)
            if until is not None and up >= until:
                del w[kind]

    # -- main loop ------------------------------------------------------------
    def step(self):
        """One main-loop iteration; returns how long to sleep (ms).

        Release timing depends on the clock only (docs/ARCHITECTURE.md): the clock is
        handled *before* the source is polled, so this step's events cannot
        delay a commit, and the idle sleep ends at the commit's due time
        (``due_up``, aligned to the synced clock's second boundaries) rather
        than at a phase set by how many events earlier steps processed. What
        remains is at most the processing time of one step's events
        (``max_events_per_step``) if that step straddles the due time.
        """
        self.wdt.feed()
        more = False
        try:
            drew = self._time()
            got = self.source.poll(self, self.cfg.max_events)
            if got >= self.cfg.max_events:
                more = True
            if self.source.dropped:
                self.source.dropped = False
                self.warn("srcdrop", "source buffer overflowed: some events were not counted")
            if got or drew:
                # what this step counted or drew and then let go of (items, digests, hash
                # contexts, frames of the samplers, random bytes) leaves the freed heap
                wipe.heap()
            if self._network():
                more = True
        except MemoryError:
            self._low_memory()
            return 200
        if more:
            return 0
        idle = self.cfg.idle_ms
        if self.clock.synced:
            left = self.due_up - self.clock.uptime_ms()
            if left < idle:
                return left if left > 0 else 0
        return idle

    def _low_memory(self):
        self.link.drop()
        gc.collect()
        self.link.next_ms = self.clock.uptime_ms() + 10000
        self.warn("lowmem", "low memory: dropped the broker connection to free its buffers (%d bytes free); "
                  "counting goes on" % gc.mem_free(), 10000)

    def _time(self):
        """The clock's part of a step; True if it may have drawn noise (a persist, a
        release, a re-dating), i.e. the step's end scrubs the heap."""
        up = self.clock.uptime_ms()
        if self.warned:
            self._expire_mutes(up)
        rec = self.rec
        drew = False
        if not self.clock.synced:
            if self.wifi.up and up >= self.ntp_next:
                drew = self._sync(up)
            if not self.clock.synced:
                if up - self.last_persist >= self.p.persist_s * 1000:
                    # an attempt counts as a persist (its draw is spent: docs/PRIVACY.md
                    # "Failed writes"), so a full flash is retried after persist_s, not every step
                    rec.persist()
                    self.last_persist = up
                    drew = True
                self.warn("unsynced", "clock not synced yet (NTP %s): counting, but no release until it is"
                          % self.cfg.ntp_host)
                return drew
        elif self.wifi.up and up - self.clock.synced_at >= self.cfg.ntp_resync_s * 1000 and up >= self.ntp_next:
            self._sync(up)
        if up < self.due_up:
            return drew
        now = self.clock.now()
        ep = self.p.epoch_s
        if now // ep >= rec.ehi:
            if self.p.mode != "tree":
                # nothing counted is lost if power fails during the commit (in tree
                # mode the other levels keep counting: a persist here would add a
                # noise draw to every open node each epoch; persist_s decides)
                rec.persist(now)
            if rec.tick(now):
                self.link.status_dirty = True
                self.outbox_hint = True
            else:
                self.warn("relfail", "could not commit the release of epochs [%d, %d) (flash full?); "
                          "still counting, will retry at the next epoch end" % (rec.elo, rec.ehi))
        else:
            rec.tick(now)
        to_end = rec.ehi * ep - now
        to_persist = rec.last_persist + self.p.persist_s - now
        if to_persist <= 0:  # the last persist failed (flash full): retry after persist_s
            to_persist = self.p.persist_s
        # aligned to the second boundaries of the synced clock (now = base + up // 1000),
        # not to the phase of this step, which depends on earlier steps' work
        self.due_up = (up // 1000 + max(1, min(to_end, to_persist))) * 1000
        return True

    def _sync(self, up):
        first = not self.clock.synced
        try:
            now = self.clock.sync(self.cfg.ntp_host, self.cfg.ntp_timeout_s)
        except Exception as exc:
            self.ntp_next = up + self.ntp_delay
            self.warn("ntp", "NTP %s did not answer (%r); retrying" % (self.cfg.ntp_host, exc))
            self.ntp_delay = min(self.ntp_delay * 2, self.cfg.ntp_retry_max_s * 1000)
            return
        self.ntp_delay = 5000
        self.ntp_next = up
        self.due_up = 0
        if first:
            log("clock synced: %d" % now)
            self._dated(now)
            self.link.status_dirty = True
        return first

    def _dated(self, now):
        """Re-date the open accumulator once UTC is known (see module doc)."""
        rec = self.rec
        ep = self.p.epoch_s
        cur = now // ep
        lo = (now - self.clock.uptime_ms() // 1000) // ep
        if self.opened_unset or rec.elo * ep < MIN_VALID_UNIX or rec.elo > cur or rec.ehi > cur + 1:
            self.opened_unset = False
            try:
                marker = storage.read_marker(rec.marker_path)
            except Exception:
                marker = None
            elo, part = lo, 0
            if marker is not None and marker[2] > elo:
                elo = min(marker[2], cur)
                if marker[1] <= elo < marker[2]:
                    part = marker[3] + 1
            log("the open accumulator was dated by an unset clock; it now covers epochs [%d, %d)" % (elo, cur + 1))
            rec.redate(elo, cur + 1, part, now)
        elif rec.ehi < cur + 1 and self.p.mode != "tree":  # tree nodes never grow: tick releases them
            log("the open accumulator [%d, %d) also holds events counted since boot: it now ends with epoch %d"
                % (rec.elo, rec.ehi, cur))
            rec.redate(rec.elo, cur + 1, rec.part, now)
        else:
            rec.persist(now)

    def _network(self):
        up = self.clock.uptime_ms()
        if not self.wifi.poll(up):
            if self.link.up:
                self.link.drop()
            return False
        return self.link.service(self, up)

    def status_json(self):
        now = self.clock.now()
        pend = self.rec.outbox.pending()
        fields = [
            ("acked_seq", self.link.last_acked),
            ("clock", "synced" if self.clock.synced else "unsynced"),
            ("dev", self.p.device),
            ("fw", "micropython/" + VERSION),
            ("next_seq", self.rec.seq),
            ("oldest_pending", pend[0] if pend else None),
            ("pending", len(pend)),
            ("rejected", self.rec.outbox.rejected()),
            ("state", "online"),
            ("ts", now),
        ]
        if self.insecure:
            fields.append(("insecure_rng", True))
        for kv in self.cfg.status_info():
            fields.append(kv)
        return self._mqtt.status_json(fields)


def _cell_bytes(p):
    """Heap per sketch cell (firmware/memory.py cell_bytes): L accumulators + one scratch array of
    int32 (window/keep: L = 1), + one shadow per accumulator under persist_noise = "shadow"."""
    return 4 * (p.levels + 1) + (4 * p.levels if p.shadow else 0)


def boot(path=config.DEFAULT_PATH, rng=None):
    """Load the config and start; an :class:`Idle` for anything that prevents it."""
    try:
        cfg = config.load(path)
    except config.ConfigError as exc:
        return Idle("config error in %s: %s" % (path, exc))
    except MemoryError:
        return Idle("out of memory reading %s" % path)
    try:
        return App(cfg, rng=rng)
    except StartError as exc:
        return Idle(str(exc))
    except config.ConfigError as exc:
        return Idle("config error in %s: %s" % (path, exc))
    except ImportError as exc:
        return Idle("missing module: %s (run deploy/flash.sh)" % exc)
    except Exception as exc:
        sys.print_exception(exc)
        return Idle("cannot start: %r" % (exc,))


def sleep(app, ms):
    """Sleep ``ms`` in slices, feeding the watchdog."""
    while ms > 0:
        s = 500 if ms > 500 else ms
        if app.running:
            app.wdt.feed()
        clock.sleep_ms(s)
        ms -= s


def main(path=config.DEFAULT_PATH, max_steps=None, rng=None):
    """The board's main loop (never returns unless ``max_steps`` is given)."""
    app = boot(path, rng)
    errors = 0
    n = 0
    while max_steps is None or n < max_steps:
        n += 1
        try:
            ms = app.step()
            errors = 0
            if ms:
                sleep(app, ms)  # inside the try: Ctrl-C mostly lands here
        except KeyboardInterrupt:
            if app.running:  # Ctrl-C from mpremote: keep what was counted
                app.rec.persist()
                wipe.heap()
                log("stopped; noisy state saved")
            raise
        except Exception as exc:
            errors += 1
            log("unexpected error in the main loop (%d in a row):" % errors)
            sys.print_exception(exc)
            sleep(app, min(1000 * errors, 60000))
    return app
