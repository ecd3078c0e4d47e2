"""Heap and time of the board firmware on MicroPython's Unix port (real GC, fixed heap).

    python -m benchmarks.firmware_unix          # full: also the smallest heap each config runs in
    python -m benchmarks.firmware_unix --frozen # the frozen image at each board's heap (memory model)
    (tests/test_firmware_unix_bench.py runs the quick part in the test suite)

Writes ``bench-results/firmware-unix.json``. The firmware boots from a flash
staged like ``deploy/flash.sh --mpy`` (tests/support/unixvm.py) and runs its real main
loop against a real mosquitto; ``tests/mpunix/bench.py`` measures inside the VM.
Heaps here are exact ``-X heapsize`` values on the VM tests/mpunix/build.sh
built: 32-bit like the ESP32/RP2040 where the compiler can build it (the JSON's
``bits``); a 64-bit VM needs about 1.5x the heap for the same code and objects.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

from tests.support import unixvm as U

OUT = U.REPO / "bench-results" / "firmware-unix.json"


def _config(port: int, w: int, device: str) -> dict[str, Any]:
    # the default CountSketch (d=4; w=1024 is pansketch.agent.params' default), keep mode like the WebAssembly figures
    return U.board_config(port, device=device, kind="cs", d=4, w=w, mode="keep", window_s=4, epoch_s=2,
                          persist_s=600)


def run_bench(binary: Path, tmp: Path, port: int, heap: str, w: int, mpy: bool = True, **opts: Any) -> dict[str, str]:
    """One VM run of tests/mpunix/bench.py; returns its ``@key value`` lines (``error`` if it failed)."""
    tmp.mkdir(parents=True, exist_ok=True)
    flash = U.stage_flash(tmp / "flash", _config(port, w, "bench-%s-%d" % (heap, w)), mpy=mpy)
    hw = tmp / "hw"
    hw.mkdir(exist_ok=True)
    (hw / "bench.json").write_text(json.dumps(opts))
    b = U.Board(binary, flash, hw, heap=heap, log=tmp / "bench.log", exact_heap=True)
    rc = b.run_script("bench", 60, also=("benchrun",))
    v = b.values()
    if rc != 0 or "done" not in v:
        v["error"] = "exit %s: %s" % (rc, "\n".join(b.text.splitlines()[-6:]))
    return v


def measure(binary: Path, tmp: Path, port: int, heap: str, w: int, **opts: Any) -> dict[str, Any]:
    v = run_bench(binary, tmp, port, heap, w, **opts)
    if "error" in v:
        return {"heap": heap, "d": 4, "w": w, "boots": False, "error": v.get("idle") or v["error"]}
    steps, live_hw, slow_ms, seq = (int(x) for x in v["loop"].split())
    fills = []
    for ln in (tmp / "bench.log").read_text().splitlines():
        if ln.startswith("@fill "):
            free, us, gcs, gc_us = ln.split()[1:]
            fills.append({"free_bytes": int(free), "us_per_event": float(us), "events_per_s": round(1e6 / float(us)),
                          "collections_per_1000_events": int(gcs), "us_per_collection": int(gc_us),
                          "gc_us_per_event": round(int(gcs) * int(gc_us) / 1000, 2)})
    return {
        "heap": heap, "d": 4, "w": w, "boots": True,
        "heap_bytes": int(v["heap"]), "live_after_boot": int(v["live_boot"]),
        "largest_free_block_after_boot": int(v["largest_free_boot"]),
        "live_with_bench_code": int(v["live_loaded"]),
        "live_high_water": live_hw, "loop_steps": steps, "slowest_step_ms": slow_ms,
        "idle_step_us": int(v["idle_step_us"]),
        "garbage_per_event": int(v["alloc_event"]),
        "us_per_event_by_free_heap": fills,
        "uart_us_per_event": float(v["uart_us"].split()[1]),
    }


def runs_in(binary: Path, tmp: Path, port: int, heap_kib: int, w: int) -> bool:
    """Does /main.py, unchanged, boot in this heap, count 300 UART lines, commit a release, publish it and
    delete it on the host's acknowledgement?"""
    flash = U.stage_flash(tmp / "flash", _config(port, w, "min-%d-%d" % (w, heap_kib)), mpy=True)
    b = U.Board(binary, flash, tmp / "hw", heap="%dK" % heap_kib, log=tmp / "board.log", exact_heap=True)
    try:
        b.start(wait=False)
        try:
            b.wait_for(r"pansketch: (running|NOT RUNNING)", 15)
        except AssertionError:
            return False
        if "NOT RUNNING" in b.text:
            return False
        b.feed(["item-%d" % (i % 64) for i in range(300)])
        done = U.wait_until(lambda: b.next_seq() >= 1 and not b.committing() and not b.outbox() or not b.running, 8)
        return done and b.running and b.next_seq() >= 1 and not b.trouble()
    finally:
        b.kill()


def min_heap(binary: Path, tmp: Path, port: int, w: int, lo: int = 64, hi: int = 320, step: int = 4) -> Optional[int]:
    """Smallest -X heapsize (KiB, multiple of ``step``) in which :func:`runs_in` holds, or None if not even ``hi``."""
    def ok(k: int) -> bool:
        return runs_in(binary, tmp / ("min-%d-%d" % (w, k)), port, k, w)

    if not ok(hi):
        return None
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        if ok(mid):
            hi = mid
        else:
            lo = mid
    return hi


MIN_HEAP_W = (64, 128, 256, 512, 1024)
# (board heap, w): the VM gets U.vm_heap(board heap), i.e. the same on a 32-bit VM
# the default sketch (w = 1024) needs 132 KiB since the failure-path, identifier and TLS code of
# this round (124 KiB before): measured in 144 KiB
FULL = (("144K", 1024), ("128K", 256), ("192K", 1024))
QUICK = (("144K", 1024),)


def main(argv: Optional[list[str]] = None, quick: bool = False) -> dict[str, Any]:
    """Measure; write bench-results/firmware-unix.json (quick: the default sketch in 144 KiB only; the other
    configs and the smallest heaps are kept from a full run on the same kind of VM)."""
    binary = U.build()
    bits = U.word_bits(binary)
    res: dict[str, Any] = {"vm": "MicroPython Unix port v1.29.0-preview, %d-bit, real GC, fixed heap (-X heapsize, "
                                 "exactly as listed), .mpy code (deploy/flash.sh --mpy layout), umqtt.simple 1.8.0, "
                                 "real mosquitto and aggregator (releases leave on its acks)" % bits,
                           "bits": bits,
                           "config": "CountSketch d=4, keep mode, epoch 2 s, dgauss rho=1/2, UART source",
                           "runs": []}
    with tempfile.TemporaryDirectory() as td:
        tmp = Path(td)
        host = U.Host(tmp / "host", persistent=False)  # mosquitto + aggregator: releases leave on its acks
        try:
            host.start_aggregator()
            for board_heap, w in (QUICK if quick else FULL):
                heap = U.vm_heap(board_heap, binary)
                r = measure(binary, tmp / ("m-%s-%d" % (heap, w)), host.port, heap, w)
                r["board_heap"] = board_heap
                res["runs"].append(r)
            if not quick:
                res["min_heap_kib"] = {str(w): min_heap(binary, tmp, host.port, w) for w in MIN_HEAP_W}
        finally:
            host.close()
    OUT.parent.mkdir(exist_ok=True)
    old = json.loads(OUT.read_text()) if OUT.exists() else {}
    for k in old:  # the frozen image's figures (frozen_main, tests/test_firmware_unix_frozen.py) stay
        if k == "frozen" or k.startswith("esp32_"):
            res[k] = old[k]
    if quick and old.get("bits") == bits:  # keep what only a full run (on this kind of VM) measures
        for k in ("min_heap_kib",):
            if k in old:
                res[k] = old[k]
        mine = {(r["heap"], r["w"]) for r in res["runs"]}
        res["runs"] += [r for r in old.get("runs", []) if (r["heap"], r["w"]) not in mine]
    OUT.write_text(json.dumps(res, indent=2, sort_keys=True) + "\n")
    return res


def frozen_main(widths: tuple[int, ...] = (512, 1024, 2048)) -> dict[str, Any]:
    """The frozen image at each board's heap (BOARDS): where the heap goes with the ESP32 example (d = 4,
    w = 1024, shadow) over plain MQTT and over TLS, and the largest power-of-two w at d = 4 (shadow and
    refresh persists, TLS) whose /main.py runs in the board's heap minus 20 KiB (so >= 20 KiB stay free at
    every moment). Merged into bench-results/firmware-unix.json under "frozen"."""
    from tests.support.broker import make_test_pki

    binary = U.build_frozen()
    res: dict[str, Any] = {"bits": U.word_bits(binary), "runs": {}, "max_w_20k_free": {}}
    with tempfile.TemporaryDirectory() as td:
        tmp = Path(td)
        pki = make_test_pki(tmp / "pki")
        host = U.Host(tmp / "host", persistent=False, tls=pki)
        try:
            host.start_aggregator()
            for name, b in BOARDS.items():
                for tls in (False, True):
                    key = "%s_%s" % (name, "tls" if tls else "plain")
                    cfg = example_config(host.tls_port, device="m-" + key)
                    if not tls:
                        del cfg["mqtt"]["tls"]
                        cfg["mqtt"]["port"] = host.port
                    res["runs"][key] = memrun(binary, tmp / key, cfg, Path(pki["ca_der"]), b["heap_kib"],
                                              b["tls_outside"])
                for scheme in ("shadow", "refresh"):
                    best = 0
                    for w in widths:
                        key = "%s_%s_%d" % (name, scheme, w)
                        cfg = example_config(host.tls_port, device="w-" + key, w=w, persist_noise=scheme)
                        r = memrun(binary, tmp / key, cfg, Path(pki["ca_der"]), b["heap_kib"] - 20,
                                   b["tls_outside"], script="main")
                        res["runs"][key] = r
                        if not r["ok"]:
                            break
                        best = w
                    res["max_w_20k_free"]["%s_%s" % (name, scheme)] = best
            # ESP8266: plain MQTT (its axTLS cannot verify certificates and is not this VM's TLS), 8 events
            # per step, refresh persists, the whole 34 KB heap (20 KiB to spare is more than half of it)
            for w in ESP8266["widths"]:
                key = "esp8266_refresh_%d" % w
                cfg = example_config(host.port, device="e-%d" % w, w=w, persist_noise="refresh")
                del cfg["mqtt"]["tls"]
                cfg["max_events_per_step"] = ESP8266["events"]
                res["runs"][key] = memrun(binary, tmp / key, cfg, Path(pki["ca_der"]), ESP8266["heap_kib"], False)
        finally:
            host.close()
    old = json.loads(OUT.read_text()) if OUT.exists() else {}
    old["frozen"] = dict(old.get("frozen", {}), **res)
    e = res["runs"]["esp32_tls"]  # the ESP32 board example, as tests/test_firmware_unix_frozen.py runs it
    if e["ok"]:
        old.update(esp32_d=e["d"], esp32_w=e["w"], esp32_heap_bytes=e["heap_bytes"], esp32_vm_bits=res["bits"],
                   esp32_free_bytes_min=e["free_at_high_water"],
                   esp32_runs_in_heap_minus_20k=res["max_w_20k_free"]["esp32_shadow"] >= e["w"])
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps(old, indent=2, sort_keys=True) + "\n")
    return res


# -- the frozen image (tests/mpunix/build-frozen.sh) at each board's heap ------------------------------
EXAMPLE = U.REPO / "deploy" / "board" / "pansketch.example.json"  # the ESP32 board example
# Board heaps: firmware/memory.py PROFILES "free" (Python heap free after boot with WiFi up, before pansketch
# is imported), and where Mbed TLS allocates on that board. The VM gets the whole figure as -X heapsize, so the
# launcher and the fake board modules (C modules on a board) count against it too: a few KB conservative.
BOARDS = {"esp32": {"heap_kib": 110, "tls_outside": True}, "picow": {"heap_kib": 160, "tls_outside": False}}
ESP8266 = {"heap_kib": 34, "events": 8, "widths": (64, 128, 256)}


def example_config(port: int, device: str = U.DEVICE, **sketch: Any) -> dict[str, Any]:
    """deploy/board/pansketch.example.json (its sketch, TLS, events per step, watchdog), on the test bench:
    loopback WiFi and broker, the test CA, 4 s windows with a persist every second (``persist_noise``
    "auto" still resolves to shadow, as for the example's 300 s persists of hourly windows: >= 2 per
    epoch), and the UART source instead of BLE (the fake radio hears nothing; UART lines make the
    64-event steps the memory model budgets)."""
    cfg = json.loads(EXAMPLE.read_text())
    cfg["device"] = device
    cfg["salt"] = U.SALT
    cfg["wifi"] = {"ssid": "loopback"}
    cfg["ntp"] = {"host": "ntp.test"}
    cfg["sketch"].update(window_s=4, persist_s=1)
    cfg["sketch"].update(sketch)
    mq = cfg["mqtt"]
    mq.update(host="127.0.0.1", port=port, timeout_s=6, retry_max_s=1, ack_timeout_s=2, keepalive_s=30)
    mq.pop("user", None)
    mq.pop("password", None)
    mq["tls"] = dict(mq["tls"], server_hostname="localhost")
    cfg["source"] = {"type": "uart", "id": 1}
    cfg["watchdog_s"] = 12  # must exceed mqtt.timeout_s: a TLS handshake in a 32-bit VM on a loaded machine
    return cfg


def memrun(binary: Path, tmp: Path, cfg: dict[str, Any], ca_der: Path, heap_kib: int, tls_outside: bool,
           releases: int = 2, events: int = 640, script: str = "memrun") -> dict[str, Any]:
    """One run of the frozen firmware (tests/mpunix/memrun.py, or ``script="main"``: /main.py unchanged)
    in ``heap_kib`` KiB of heap (1.5x on a 64-bit VM), UART fed with ``events`` lines; returns its figures
    (``ok`` False and ``error`` if it did not get ``releases`` releases published and acknowledged)."""
    tmp.mkdir(parents=True, exist_ok=True)
    flash = U.stage_flash(tmp / "flash", cfg, frozen=True)
    shutil.copyfile(ca_der, flash / "ca.der")
    hw = tmp / "hw"
    hw.mkdir(exist_ok=True)
    (hw / "memrun.json").write_text(json.dumps({"tls_outside": tls_outside, "releases": releases}))
    heap = U.vm_heap("%dK" % heap_kib, binary)
    b = U.Board(binary, flash, hw, heap=heap, log=tmp / "board.log", exact_heap=True)
    b.feed(["ble-%02d:%02d" % (i % 7, i % 13) for i in range(events)])
    res: dict[str, Any] = {"heap_kib": heap_kib, "vm_heap": heap, "ok": False}
    if script == "main":  # the board's own main.py: does it run in this heap?
        if tls_outside:
            # Mbed TLS on libc, then the board's main.py as board.py would run it
            # (the 64-bit build has no tlsalloc: its Mbed TLS is on libc already)
            (hw / "tlsout.py").write_text("try:\n    import tlsalloc\n    tlsalloc.outside()\n    del tlsalloc\n"
                                          "except ImportError:\n    pass\nimport main\n")
        try:
            b.start(wait=False, script="tlsout" if tls_outside else None)
            # acknowledged: counted, then (in this order) nothing on its way to the outbox and nothing in
            # it (a release between its marker and its rename is in neither: a board killed then never
            # publishes it; tests/support/unixvm.py Board.committing)
            ok = U.wait_until(lambda: b.next_seq() >= releases and not b.committing() and not b.outbox()
                              or not b.running, 40)
            res.update(ok=bool(ok and b.running and b.next_seq() >= releases and not b.trouble()),
                       released=b.next_seq(), connected="(TLS)" in b.text)
            if not res["ok"]:
                res["error"] = "\n".join(b.text.splitlines()[-8:])
        finally:
            b.kill()
        return res
    rc = b.run_script(script, 120)
    v = b.values()
    if rc != 0 or "done" not in v:
        res["error"] = v.get("idle") or "exit %s: %s" % (rc, "\n".join(b.text.splitlines()[-8:]))
        return res
    steps, hw_live, persists, seq = (int(x) for x in v["loop"].split())
    kind, d, w, cells, shadow = v["sketch"].split()
    up, tls = (int(x) for x in v["connected"].split())
    heap_bytes = int(v["heap"])
    res.update(ok=bool(up and seq >= releases), heap_bytes=heap_bytes, tls_alloc=v["tls"], tls=bool(tls),
               kind=kind, d=int(d), w=int(w), shadow=bool(int(shadow)),
               live_vm=int(v["live_vm"]), live_code=int(v["live_code"]), live_boot=int(v["live_boot"]),
               live_connected=int(v.get("live_connected", "0")), live_high_water=hw_live,
               largest_free_block_after_boot=int(v["largest_free_boot"]), steps=steps, persists=persists,
               released=seq, free_at_high_water=heap_bytes - hw_live,
               code=int(v["live_code"]) - int(v["live_vm"]), sketch_and_app=int(v["live_boot"]) - int(v["live_code"]))
    return res


if __name__ == "__main__":
    if "--frozen" in sys.argv[1:]:
        json.dump(frozen_main(), sys.stdout, indent=2, sort_keys=True)
    else:
        json.dump(main(sys.argv[1:]), sys.stdout, indent=2)
    print()
