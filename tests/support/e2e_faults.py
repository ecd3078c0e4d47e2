"""Shared by tests/test_e2e_faults.py and the tests that build on it: ACK_TIMEOUT_S, Device, Host, ROWS, SPEED, STORED_LINE, Scene, StatusRecorder, T0, host_config."""

from __future__ import annotations

import json
import os
import re
import subprocess
import threading
import time
from collections import Counter
from typing import Any, Optional
from pansketch.host_tools.localnet import stop_process
from pansketch.host_tools.ingest import devstatus
from pansketch.host_tools.store.sqlite import Store
from tests.support.e2e import (REPO, SALT, agent_cmd, agent_env, agent_toml, pansketch_cmd,
                                    start_mosquitto, wait_for)


T0 = 1_700_000_000 - 1_700_000_000 % 3600  # in the past: the host quarantines windows from the future


SPEED = 60.0  # a 60 s window per real second


ROWS: list[dict[str, Any]] = []


ACK_TIMEOUT_S = 1.0  # the devices' ack_timeout_s (Device below)


STORED_LINE = re.compile(r"(?:INFO|DEBUG) stored (?:release )?[A-Za-z0-9._-]+ seq \d+")


# -- processes --------------------------------------------------------------------
class Device:
    """One ``pansketch-agent feed`` process on a fast clock, fed events until ``finish()``."""

    def __init__(self, tmp: Any, name: str, port: int, outbox_max: int = 0, persist_s: int = 60,
                 ack_timeout_s: float = ACK_TIMEOUT_S) -> None:
        self.name = name
        self.state = str(tmp / ("state-" + name))
        self.log = str(tmp / ("agent-%s.log" % name))
        self.config = agent_toml(str(tmp / ("%s.toml" % name)), name, port, self.state, window_s=60, w=64,
                                 persist_s=persist_s)
        with open(self.config) as f:
            text = f.read()
        text = text.replace("ack_timeout_s = 2", "ack_timeout_s = %g" % ack_timeout_s)
        if outbox_max:
            text = text.replace("[storage]\n", "[storage]\noutbox_max = %d\n" % outbox_max)
        with open(self.config, "w") as f:
            f.write(text)
        self.t_launch = time.time()
        self.proc: Optional[subprocess.Popen[bytes]] = None
        self._feeding = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.start(T0)

    def start(self, clock_start: float) -> None:
        out = open(self.log, "ab")
        self.proc = subprocess.Popen(agent_cmd("feed", self.config, "--timeout", "40", "--clock-start",
                                               "%.0f" % clock_start, "--clock-speed", str(SPEED)),
                                     stdin=subprocess.PIPE, stdout=out, stderr=out, env=agent_env(), cwd=REPO)
        out.close()
        self._feeding.set()
        self._thread = threading.Thread(target=self._feed, args=(self.proc,), daemon=True)
        self._thread.start()

    def _feed(self, proc: "subprocess.Popen[bytes]") -> None:
        i = 0
        try:
            while self._feeding.is_set() and proc.poll() is None:
                proc.stdin.write(b"item-%d\n" % (i % 5))
                proc.stdin.flush()
                i += 1
                time.sleep(0.02)
            if proc.poll() is None:
                proc.stdin.close()  # end of input: release the open window, wait for the host
        except (BrokenPipeError, ValueError, OSError):
            pass

    def now_sim(self) -> float:
        return T0 + (time.time() - self.t_launch) * SPEED

    def kill(self) -> None:
        """kill -9, then restart on the same state directory with the clock going on."""
        self._feeding.clear()
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(10)
        if self._thread is not None:
            self._thread.join(5)

    def restart(self) -> None:
        self.start(self.now_sim())

    def finish(self, timeout: float = 45) -> int:
        """Close the input; the exit code of feed (0: the host stored every release)."""
        self._feeding.clear()
        if self._thread is not None:
            self._thread.join(5)
        assert self.proc is not None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return -9

    def pending(self) -> list[int]:
        d = os.path.join(self.state, "outbox")
        return sorted(int(n[:10]) for n in os.listdir(d) if n.endswith(".cbor")) if os.path.isdir(d) else []

    def snapshot(self) -> dict[int, bytes]:
        """The outbox's releases, as bytes."""
        out = {}
        for q in self.pending():
            try:
                with open(os.path.join(self.state, "outbox", "%010d.cbor" % q), "rb") as f:
                    out[q] = f.read()
            except FileNotFoundError:  # acknowledged meanwhile
                pass
        return out

    def next_seq(self) -> int:
        """Every seq below this was released (the last committed release + 1)."""
        try:
            with open(os.path.join(self.state, "released")) as f:
                return int(f.read().split()[0]) + 1
        except FileNotFoundError:
            return 0

    def text(self) -> str:
        with open(self.log, encoding="utf-8", errors="replace") as f:
            return f.read()

    def cleanup(self) -> None:
        self._feeding.clear()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def host_config(tmp: Any, port: int, name: str, shared_group: str = "") -> str:
    path = str(tmp / ("%s.toml" % name))
    with open(path, "w") as f:
        f.write('[broker]\nhost = "127.0.0.1"\nport = %d\nclient_id = "%s"\nreconnect_min_s = 1\nreconnect_max_s = 1\n'
                '[aggregator]\ndb = "%s"\n%s[fleet]\nsalt = "%s"\n'
                % (port, name, str(tmp / "fleet.db"), 'shared_group = "%s"\n' % shared_group if shared_group else "",
                   SALT))
    return path


class Host:
    """One ``pansketch aggregate -v`` process (``config``: another host config than :func:`host_config`'s,
    up once its log shows ``ready`` within ``ready_s`` seconds)."""

    def __init__(self, tmp: Any, port: int, name: str = "agg", shared_group: str = "", config: str = "",
                 ready: str = "subscribing", ready_s: float = 20) -> None:
        self.config = config or host_config(tmp, port, name, shared_group)
        self.log = str(tmp / ("%s.log" % name))
        out = open(self.log, "ab")
        self.proc = subprocess.Popen(pansketch_cmd("aggregate", "--config", self.config, "-v"), stdout=out,
                                     stderr=out, env=agent_env(), cwd=REPO)
        out.close()
        assert wait_for(lambda: ready in self.text() or self.proc.poll() is not None, ready_s), self.text()
        assert self.proc.poll() is None, self.text()

    def text(self) -> str:
        with open(self.log, encoding="utf-8", errors="replace") as f:
            return f.read()

    def stored(self) -> int:
        """Releases this aggregator stored (from its log: 'stored <dev> seq N')."""
        return len(STORED_LINE.findall(self.text()))

    def stop(self) -> None:
        stop_process(self.proc, 15)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


class StatusRecorder:
    """Device status messages -> the store via pansketch.host_tools.ingest.devstatus (stands in for the aggregator's subscription)."""

    def __init__(self, port: int, db: str) -> None:
        import paho.mqtt.client as mqtt

        self.db = db
        self.store: Optional[Store] = None
        self.lock = threading.Lock()
        self.seen = 0
        ready = threading.Event()
        c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="status-recorder", protocol=mqtt.MQTTv5)
        c.on_connect = lambda cl, u, f, rc, p=None: cl.subscribe("pansketch/+/status", qos=1)
        c.on_subscribe = lambda cl, u, mid, rcs, p=None: ready.set()
        c.on_message = self._on_message
        c.reconnect_delay_set(1, 1)
        c.connect_async("127.0.0.1", port)
        c.loop_start()
        self.client = c
        assert ready.wait(10)

    def _on_message(self, c: Any, u: Any, msg: Any) -> None:
        with self.lock:
            if self.store is None:
                self.store = Store(self.db)
            devstatus.record(self.store, msg.topic, msg.payload)
            self.seen += 1

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()
        with self.lock:
            if self.store is not None:
                self.store.close()


class Scene:
    """Broker + status recorder + cleanup of every process of one fault test."""

    device_class = Device

    def __init__(self, tmp: Any, autosave_interval: int = 1) -> None:
        self.tmp = tmp
        self.db = str(tmp / "fleet.db")
        self.broker = start_mosquitto(tmp, persistent=True, autosave_interval=autosave_interval)
        self.port = self.broker.port
        self.status = StatusRecorder(self.port, self.db)
        self.devices: list[Device] = []
        self.hosts: list[Host] = []

    def device(self, name: str, **kw: Any) -> Device:
        d = self.device_class(self.tmp, name, self.port, **kw)
        self.devices.append(d)
        return d

    def host(self, name: str = "agg", shared_group: str = "") -> Host:
        h = Host(self.tmp, self.port, name, shared_group)
        self.hosts.append(h)
        return h

    def store_seqs(self) -> dict[str, list[int]]:
        if not os.path.exists(self.db):
            return {}
        st = Store(self.db, readonly=True)
        try:
            out: dict[str, list[int]] = {}
            for r in st.releases():
                out.setdefault(r.device, []).append(r.seq)
            return out
        finally:
            st.close()

    def unstored(self, devices: list[Device]) -> list[tuple[str, int]]:
        """Released but not (yet) stored: what a fault now could lose without host acknowledgements."""
        have = self.store_seqs()
        return [(d.name, q) for d in devices for q in range(d.next_seq()) if q not in have.get(d.name, [])]

    def finish_and_check(self, fault: str, at_risk: Optional[int] = None) -> dict[str, Any]:
        """Every device to the end of its input; then nothing lost, nothing twice; a fault-table row."""
        codes = {d.name: d.finish() for d in self.devices}
        assert all(c == 0 for c in codes.values()), (codes, {d.name: d.text()[-3000:] for d in self.devices})
        for h in self.hosts:
            if h.proc.poll() is None:
                assert "Traceback" not in h.text(), h.text()
        time.sleep(0.3)  # the devices' last status messages
        st = Store(self.db, readonly=True)
        try:
            rels = st.releases()
            rejections = st.rejections()
            duplicates = st.duplicate_count()
        finally:
            st.close()
        per = Counter((r.device, r.seq) for r in rels)
        released = {d.name: d.next_seq() for d in self.devices}
        want = {(d, s) for d, n in released.items() for s in range(n)}
        lost = want - set(per)
        twice = [k for k, n in per.items() if n > 1]
        assert not rejections, rejections  # a conflict here would mean noise re-drawn for released data
        assert not lost, sorted(lost)
        assert not twice, twice
        assert set(per) == want, sorted(set(per) - want)
        for d in self.devices:
            assert d.pending() == [], (d.name, d.pending())
        r = subprocess.run(pansketch_cmd("status", "--config", self.hosts[0].config, "--json"), capture_output=True,
                           text=True, env=agent_env(), cwd=REPO, timeout=60)
        assert r.returncode == 0, r.stderr
        rep = json.loads(r.stdout)
        devs = {x["device"]: x for x in rep["devices"]}
        assert set(devs) == set(released)
        for name, n in released.items():
            x = devs[name]
            assert x["basis"] == "device status", x  # classified with the device's own next_seq
            assert x["stored_count"] == n and x["checked"][1] >= n, x
        assert rep["delivery"]["lost"] == 0 and rep["delivery"]["unknown"] == 0, rep["delivery"]
        assert rep["delivery"]["pending"] == 0 and rep["delivery"]["rejected"] == 0, rep["delivery"]
        row = {"fault": fault, "devices": len(self.devices), "at_risk": at_risk, "released": len(want), "stored": len(per),
               "lost": len(lost) + rep["delivery"]["lost"], "stored_twice": len(twice),
               "duplicates_ignored": duplicates}
        ROWS.append(row)
        return row

    def stop_processes(self) -> None:
        for d in self.devices:
            d.cleanup()
        for h in self.hosts:
            if h.proc.poll() is None:
                h.proc.kill()
                h.proc.wait(10)

    def close(self) -> None:
        self.stop_processes()
        self.status.close()
        self.broker.stop()
