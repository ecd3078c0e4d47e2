"""Helpers for the dashboard tests: a demo store, a running ``pansketch serve``, headless Chromium.

* :func:`demo_store` runs the real ``pansketch demo`` (real mosquitto,
  simulated agents) into a directory, then adds device ``pi-gap`` whose
  release seq 2 never arrives (its window is missing), a duplicate delivery
  and two rejected messages -- through the real aggregator core.
* :class:`Server` runs ``pansketch serve --port 0`` as a subprocess and
  reads the URL it prints.
* :func:`chromium` runs Debian's ``chromium`` headless (fresh profile, no
  background networking) for ``--dump-dom`` or ``--screenshot``. Tests
  using it are skipped, with the reason, when chromium is not installed
  (``.ci/run`` installs it).

Set ``PANSKETCH_SCREENSHOTS=DIR`` to keep the screenshots (docs/ uses them).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Optional

import pytest

from pansketch.host_tools.localnet import stop_process

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GAP_DEVICE = "pi-gap"
# the cs fleet only: these tests count its devices and releases; the demo's other kinds (cms, tree,
# dcs, dbits) are walked by tests/test_first_hour.py
DEMO_ARGS = ["--agents", "3", "--windows", "4", "--events", "2000", "--w", "256", "--items", "500", "--cs-only"]


def pansketch(*args: str) -> list[str]:
    return [sys.executable, "-m", "pansketch.host_tools.cli", *args]


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = REPO + os.pathsep + e.get("PYTHONPATH", "")
    return e


def chromium_path() -> Optional[str]:
    for name in ("chromium", "chromium-browser"):
        p = shutil.which(name)
        if p:
            return p
    return None


needs_chromium = pytest.mark.skipif(chromium_path() is None,
                                    reason="chromium is not installed (.ci/run installs Debian's chromium)")


def demo_store(root: str) -> str:
    """A demo store in ``root``; returns the host config path."""
    r = subprocess.run(pansketch("demo", *DEMO_ARGS, "--dir", root), capture_output=True, text=True, env=env(),
                       cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    conf = os.path.join(root, "host.toml")
    add_gap_device(conf)
    return conf


def add_gap_device(conf: str) -> None:
    from pansketch.agent.params import Params
    from pansketch.host_tools import hostconfig
    from pansketch.host_tools.ingest.aggregator import Aggregator
    from pansketch.host_tools.demo import SALT, T0, ZipfStream
    from tests.support.host import record

    from pansketch.host_tools.store.backend import open_store

    cfg = hostconfig.load(conf)
    with open_store(cfg.aggregator.db, readonly=True) as st:  # the shape of the demo's cs fleet
        _dev, _salt, _hv, kind, d, w, *_r = next(r for r in st.devices() if r[0] == "demo-pi-1")
    p = Params({"device": GAP_DEVICE, "salt": SALT, "kind": kind, "d": d, "w": w,
                "mode": "window", "window_s": 3600, "mechanism": "dgauss", "budget": "1/2"})
    zs = ZipfStream(500, 1.1, 99)
    with tempfile.TemporaryDirectory() as tmp:
        rels = record(p, tmp, [zs.sample(1500) for _ in range(4)], t_start=T0)
    agg = Aggregator(cfg)
    try:
        topic = "pansketch/%s/release" % GAP_DEVICE
        for i, payload in enumerate(rels):
            if i != 2:  # seq 2 (the third window) never arrives
                assert agg.handle(topic, payload).status == "stored"
        assert agg.handle(topic, rels[0]).status == "duplicate"
        assert agg.handle(topic, b"\xff\x00 not cbor").status == "rejected"
        assert agg.handle("pansketch/other-dev/release", rels[1]).status == "rejected"
    finally:
        agg.close()


class Server:
    """``pansketch serve`` on a free loopback port (subprocess)."""

    def __init__(self, conf: str, *extra: str) -> None:
        self.proc = subprocess.Popen(pansketch("serve", "--config", conf, "--port", "0", *extra),
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env(), cwd=REPO)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if "http://" not in line:
            self.stop()
            raise AssertionError("serve did not start: %r" % line)
        self.url = line.split()[2].rstrip("/")

    def stop(self) -> None:
        stop_process(self.proc)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def chromium(url: str, *, dump_dom: bool = False, screenshot: Optional[str] = None, size: str = "1400,1000",
             budget_ms: int = 2000) -> str:
    """Load ``url`` in headless Chromium; returns the DOM after scripts ran (``dump_dom``)."""
    exe = chromium_path()
    if exe is None:
        pytest.skip("chromium is not installed")
    profile = tempfile.mkdtemp(prefix="pansketch-chromium-")
    args = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-extensions",
            "--user-data-dir=" + profile, "--window-size=" + size, "--hide-scrollbars",
            "--virtual-time-budget=%d" % budget_ms]
    if dump_dom:
        args.append("--dump-dom")
    if screenshot:
        args.append("--screenshot=" + screenshot)
    args.append(url)
    try:
        t = time.monotonic()
        r = subprocess.run(args, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr[-2000:]
        if screenshot:
            assert os.path.exists(screenshot), r.stderr[-2000:]
            keep = os.environ.get("PANSKETCH_SCREENSHOTS")
            if keep:
                os.makedirs(keep, exist_ok=True)
                shutil.copy(screenshot, os.path.join(keep, os.path.basename(screenshot)))
        chromium.seconds += time.monotonic() - t  # type: ignore[attr-defined]
        return r.stdout
    finally:
        shutil.rmtree(profile, ignore_errors=True)


chromium.seconds = 0.0  # type: ignore[attr-defined]
