"""Event sources: line parsing, stdin pipes, followed files (rotation), MQTT field paths."""

from __future__ import annotations

import os
import queue
import time

import pytest

from pansketch.agent.pi.config import ConfigError, SourceConfig, field_path
from pansketch.agent.pi import sources
from pansketch.agent.pi.sources import EOF, FdLineReader, FileSource, MqttSource, StdinSource, Warner, extract, parse_lines


def collect(q: "queue.Queue", until_eof: bool = True, timeout: float = 5.0, want: int | None = None):
    items, weights = [], []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            b = q.get(timeout=0.05)
        except queue.Empty:
            if want is not None and len(items) >= want:
                break
            continue
        if b is EOF:
            return items, weights, True
        its, ws = b
        items += its
        weights += ws if ws is not None else [1] * len(its)
        if not until_eof and want is not None and len(items) >= want:
            break
    return items, weights, False


def test_parse_lines_items_weights_and_bad_lines():
    logged = []
    warn = Warner(logged.append)
    items, weights = parse_lines(b"a\nb\r\n\nc d\n", warn)
    assert items == ["a", "b", "c d"] and weights is None
    items, weights = parse_lines(b"a\t3\nb\nx\ty\t-2\nbad\tw\nz\t 7 \n", warn)
    assert items == ["a", "b", "x\ty", "z"]
    assert weights == [3, 1, -2, 7]
    assert len(logged) == 1 and "bad" not in logged[0], "warnings must not echo the event"
    parse_lines(b"bad\tw\n", warn)
    assert len(logged) == 1, "warnings are rate limited"
    items, _ = parse_lines("caf\u00e9\n".encode() + b"\xff\xfe\n", warn)
    assert items == ["caf\u00e9", "\ufffd\ufffd"]


def test_stdin_source_joins_lines_split_across_reads():
    r, w = os.pipe()
    q: "queue.Queue" = queue.Queue()
    src = StdinSource(q, lambda m: None, fd=r)
    src.start()
    os.write(w, b"alp")
    time.sleep(0.05)
    os.write(w, b"ha\nbe")
    time.sleep(0.05)
    os.write(w, b"ta\t2\ngamma")  # last line without newline still counts at EOF
    os.close(w)
    items, weights, eof = collect(q)
    os.close(r)
    assert eof
    assert items == ["alpha", "beta", "gamma"] and weights == [1, 2, 1]


def test_a_line_longer_than_max_line_is_skipped_and_memory_stays_bounded(monkeypatch):
    """Input without newlines used to grow the carried-over line without limit (and copy it on every
    read). Lines up to MAX_LINE bytes are counted, longer ones are skipped with one warning that
    names no content, whether they end in the read that started them, a later one, or never;
    the carried-over bytes never exceed MAX_LINE."""
    monkeypatch.setattr(sources, "MAX_LINE", 16)
    logged = []
    rd = FdLineReader(Warner(logged.append))
    out = []
    for data in (b"ok1\n" + b"x" * 10, b"y" * 10, b"z" * 30, b"still\nok2\npart", b"ial\n" + b"q" * 17):
        out += rd.feed(data)
        assert len(rd.rest) <= 16
    out += rd.feed(b"\n" + b"a" * 16 + b"\nlast")
    out.append(rd.tail())
    assert b"".join(out).split(b"\n") == [b"ok1", b"ok2", b"partial", b"a" * 16, b"last"]
    assert len(logged) == 1 and "longer than 16 bytes" in logged[0]
    assert not any(c * 5 in logged[0] for c in "xyzq")
    # a carried-over line that ends within MAX_LINE is kept, one that ends past it is skipped
    rd = FdLineReader()
    assert rd.feed(b"k" * 10) == [] and rd.feed(b"k" * 6 + b"\n") == [b"k" * 16 + b"\n"]
    assert rd.feed(b"m" * 10) == [] and rd.feed(b"m" * 7 + b"\nn\n") == [b"n\n"]


def test_file_source_once(tmp_path):
    p = tmp_path / "ev.txt"
    p.write_text("a\nb\nc\n")
    q: "queue.Queue" = queue.Queue()
    src = FileSource(q, lambda m: None, SourceConfig(type="file", path=str(p), follow=False))
    assert src.finite
    src.start()
    items, _, eof = collect(q)
    assert eof and items == ["a", "b", "c"]


def _wait_open(path: str, at: int, timeout: float) -> bool:
    """True once this process has ``path`` open at offset ``at`` (the source thread's descriptor)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        for fd in os.listdir("/proc/self/fd"):
            try:
                if os.readlink("/proc/self/fd/" + fd) == path:
                    with open("/proc/self/fdinfo/" + fd) as info:
                        if "pos:\t%d\n" % at in info.read():
                            return True
            except OSError:
                pass
        time.sleep(0.01)
    return False


def test_file_source_follows_appends_rotation_and_truncation(tmp_path):
    p = tmp_path / "ev.log"
    p.write_text("old1\nold2\n")  # present before start: not counted (tail -F semantics)
    q: "queue.Queue" = queue.Queue()
    logs: list[str] = []
    src = FileSource(q, logs.append, SourceConfig(type="file", path=str(p), follow=True, from_start=False))
    src.POLL_S = 0.02
    src.start()
    # the source seeks to the end when it opens the file: append only once it has it open
    assert _wait_open(str(p), os.path.getsize(p), 10), "the source did not open %s" % p
    with open(p, "a") as f:
        f.write("n1\nn2\n")
    items, _, _ = collect(q, until_eof=False, want=2, timeout=3)
    assert items == ["n1", "n2"]
    # rotation: logrotate moves the file away and creates a new one
    with open(p, "a") as f:
        f.write("n3\n")
    time.sleep(0.1)
    os.rename(p, tmp_path / "ev.log.1")
    p.write_text("r1\nr2\n")
    items, _, _ = collect(q, until_eof=False, want=3, timeout=3)
    assert items == ["n3", "r1", "r2"]
    # truncation in place (copytruncate)
    time.sleep(0.1)
    with open(p, "w") as f:
        f.write("t\n")
    items, _, _ = collect(q, until_eof=False, want=1, timeout=3)
    assert items == ["t"]
    src.stop()
    assert not any("old" in m for m in logs)


@pytest.mark.parametrize(
    "spec,expect",
    [
        ("payload.mac", ["aa:bb"]),
        ("payload.BLE.0.mac", ["11:22"]),
        ("payload.list", ["x", "7"]),
        ("topic.1", ["sensor-3"]),
        ("payload.n", ["42"]),
    ],
)
def test_mqtt_field_paths(spec, expect):
    q: "queue.Queue" = queue.Queue()
    src = MqttSource(q, lambda m: None, SourceConfig(type="mqtt", topic="tele/+/SENSOR", field=spec), "c")
    payload = b'{"mac": "aa:bb", "BLE": [{"mac": "11:22"}], "list": ["x", 7], "n": 42.0}'
    items, weights = src.handle("tele/sensor-3/SENSOR", payload)
    assert items == expect and weights is None


def test_mqtt_weight_field_missing_field_and_raw_payload():
    logs: list[str] = []
    q: "queue.Queue" = queue.Queue()
    src = MqttSource(q, logs.append, SourceConfig(type="mqtt", topic="t", field="payload.id",
                                                  weight_field="payload.n"), "c")
    assert src.handle("t", b'{"id": "a", "n": 3}') == (["a"], [3])
    assert src.handle("t", b'{"other": 1}') is None  # other traffic (state, LWT) is ignored silently
    assert logs == []
    assert src.handle("t", b'{"id": "a", "n": "three"}') is None
    assert len(logs) == 1 and "not an integer" in logs[0]
    raw = MqttSource(q, logs.append, SourceConfig(type="mqtt", topic="t", field="payload"), "c")
    assert raw.handle("t", b"ON") == (["ON"], None)  # not JSON: the text itself


def test_field_path_validation():
    assert field_path("payload.a.0", "k") == ["payload", "a", "0"]
    for bad in ("mac", "payload..a", "topic.1.2", ""):
        with pytest.raises(ConfigError):
            field_path(bad, "source.field")
    with pytest.raises(KeyError):
        extract({"topic": "a/b", "payload": {}}, ["payload", "x"])


def test_a_failing_source_stops_the_daemon_with_exit_3(tmp_path):
    """An unreadable event file must not leave a daemon running that counts nothing."""
    import subprocess
    import sys

    from tests.support.e2e import REPO, agent_env, free_port

    cfg = tmp_path / "a.toml"
    cfg.write_text('[device]\nid = "x1"\nsalt = "saltsalt1"\n[storage]\ndir = "st"\n[broker]\nport = %d\n'
                   '[source]\ntype = "file"\npath = "missing.log"\nfollow = false\n' % free_port())
    r = subprocess.run([sys.executable, "-m", "pansketch.agent.pi.daemon", "run", "--config", str(cfg), "--timeout", "1"],
                       capture_output=True, cwd=REPO, env=agent_env(), timeout=60)
    assert r.returncode == 3
    assert b"event source failed" in r.stderr and b"missing.log" in r.stderr
    assert not os.listdir(tmp_path / "st" / "outbox"), "no early release for an input that was never read"


def _mqtt_source_cfg(tmp_path, broker_port: int, source_port: int):
    cfg = tmp_path / "m.toml"
    cfg.write_text('[device]\nid = "x2"\nsalt = "saltsalt1"\n[storage]\ndir = "st"\n[broker]\nport = %d\n'
                   '[source]\ntype = "mqtt"\nport = %d\ntopic = "tele/+/SENSOR"\nfield = "payload.id"\n'
                   % (broker_port, source_port))
    return cfg


def test_mqtt_source_with_its_broker_down_says_so_at_once(tmp_path):
    """`run` with a local source broker that is down logged nothing at all."""
    import signal
    import subprocess
    import sys

    from tests.support.e2e import REPO, agent_env, free_port

    cfg = _mqtt_source_cfg(tmp_path, free_port(), free_port())
    errf = tmp_path / "agent.err"
    want = b"cannot connect to the local source broker localhost:"
    with open(errf, "wb") as ef:
        p = subprocess.Popen([sys.executable, "-m", "pansketch.agent.pi.daemon", "run", "--config", str(cfg)],
                             stderr=ef, cwd=REPO, env=agent_env())
        try:
            # "at once": within seconds of start (a cold, loaded machine takes 1-2 s to get there)
            end = time.monotonic() + 20
            while want not in errf.read_bytes() and p.poll() is None and time.monotonic() < end:
                time.sleep(0.05)
        finally:
            p.send_signal(signal.SIGTERM)
            p.wait(timeout=30)
    err = errf.read_bytes()
    assert want in err, err


def test_check_tries_the_mqtt_source_broker(tmp_path):
    """`check` connects to the source broker too: the main broker up, the source broker down -> exit 1."""
    import subprocess
    import sys

    from tests.support.broker import Mosquitto, mosquitto_path
    from tests.support.e2e import REPO, agent_env, free_port

    if mosquitto_path() is None:
        pytest.skip("mosquitto not installed")
    m = Mosquitto(tmp_path)
    try:
        down = free_port()
        r = subprocess.run([sys.executable, "-m", "pansketch.agent.pi.daemon", "check", "--config",
                            str(_mqtt_source_cfg(tmp_path, m.port, down)), "--timeout", "2"],
                           capture_output=True, cwd=REPO, env=agent_env(), timeout=60, text=True)
        assert r.returncode == 1, r.stdout + r.stderr
        assert "source mqtt localhost:%d topic tele/+/SENSOR: FAILED" % down in r.stdout
        assert "local source broker" in r.stderr and "cannot reach the broker" not in r.stderr
        ok = subprocess.run([sys.executable, "-m", "pansketch.agent.pi.daemon", "check", "--config",
                             str(_mqtt_source_cfg(tmp_path, m.port, m.port)), "--timeout", "2"],
                            capture_output=True, cwd=REPO, env=agent_env(), timeout=60, text=True)
        assert ok.returncode == 0, ok.stdout + ok.stderr
        assert "source mqtt localhost:%d topic tele/+/SENSOR: OK" % m.port in ok.stdout
    finally:
        m.stop()


def test_feed_no_flush_delivers_only_the_outbox(tmp_path):
    """`feed < /dev/null` (to flush the outbox) made a noise-only release. That release stays:
    whether one exists must not depend on the data (none counted). --no-flush is the data-independent way."""
    import subprocess
    import sys

    from tests.support.e2e import REPO, agent_env, free_port

    cfg = tmp_path / "f.toml"
    cfg.write_text('[device]\nid = "x3"\nsalt = "saltsalt1"\n[storage]\ndir = "st"\n[broker]\nport = %d\n'
                   % free_port())
    base = [sys.executable, "-m", "pansketch.agent.pi.daemon", "feed", "--config", str(cfg), "--timeout", "1"]
    with open(os.devnull, "rb") as null:
        r = subprocess.run(base + ["--no-flush"], stdin=null, capture_output=True, cwd=REPO, env=agent_env(), timeout=60)
    assert r.returncode == 0, r.stderr
    assert not os.listdir(tmp_path / "st" / "outbox"), "--no-flush made a release"
    with open(os.devnull, "rb") as null:
        r = subprocess.run(base, stdin=null, capture_output=True, cwd=REPO, env=agent_env(), timeout=60)
    assert r.returncode == 1  # no broker: the release waits in the outbox
    assert len(os.listdir(tmp_path / "st" / "outbox")) == 1, "end of input releases, events or not"
