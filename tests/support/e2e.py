"""Helpers for the agent and end-to-end tests.

Real parts only: a real mosquitto (tests/support/broker.py, shared with the host tests),
the real ``pansketch-agent`` as a subprocess, real paho clients.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Optional

# the agent and host configs, the agent's command line and the aggregator thread are the benchmarks' (re-exported)
from pansketch.host_tools.bench.localfleet import (  # noqa: F401
    LIVE, REPO, SALT, AggregatorThread, agent_cmd, agent_env, agent_toml, host_toml)
from pansketch.host_tools.localnet import wait_until
from tests.support.broker import free_port, mosquitto_path, needs_mosquitto, start_mosquitto  # noqa: F401  (re-exported)


def run_agent(command: str, config: str, *extra: str, input: bytes = b"", timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(agent_cmd(command, config, *extra), input=input, capture_output=True, env=agent_env(),
                          cwd=REPO, timeout=timeout)


def spawn_agent(command: str, config: str, *extra: str, log: Optional[str] = None) -> subprocess.Popen:
    out = open(log, "ab") if log else subprocess.DEVNULL
    return subprocess.Popen(agent_cmd(command, config, *extra), stdin=subprocess.PIPE, stdout=out, stderr=out,
                            env=agent_env(), cwd=REPO)


class Capture:
    """A real paho subscriber recording every message (topic, payload, retain)."""

    def __init__(self, port: int, topics: list[str], username: Optional[str] = None, password: Optional[str] = None,
                 client_id: str = "capture", persistent: bool = False) -> None:
        import paho.mqtt.client as mqtt
        from paho.mqtt.packettypes import PacketTypes
        from paho.mqtt.properties import Properties

        self.msgs: list[tuple[str, bytes, bool]] = []
        self.cond = threading.Condition()
        self.ready = threading.Event()
        c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5)
        if username:
            c.username_pw_set(username, password)

        def on_connect(cl: Any, u: Any, f: Any, rc: Any, p: Any = None) -> None:
            for t in topics:
                cl.subscribe(t, qos=1)

        def on_subscribe(cl: Any, u: Any, mid: Any, rcs: Any, p: Any = None) -> None:
            self.ready.set()

        def on_message(cl: Any, u: Any, m: Any) -> None:
            with self.cond:
                self.msgs.append((m.topic, bytes(m.payload), bool(m.retain)))
                self.cond.notify_all()

        c.on_connect, c.on_subscribe, c.on_message = on_connect, on_subscribe, on_message
        c.reconnect_delay_set(1, 1)
        props = None
        if persistent:  # the broker queues QoS 1 messages for us while we are disconnected
            props = Properties(PacketTypes.CONNECT)
            props.SessionExpiryInterval = 600
        c.connect_async("127.0.0.1", port, clean_start=not persistent, properties=props)
        c.loop_start()
        self.client = c
        assert self.ready.wait(10), "capture client did not subscribe"

    def wait(self, pred: Any, timeout: float = 20.0) -> bool:
        deadline = time.monotonic() + timeout
        with self.cond:
            while not pred(self.msgs):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.cond.wait(min(left, 0.2))
            return True

    def on(self, suffix: str) -> list[bytes]:
        with self.cond:
            return [p for t, p, _ in self.msgs if t.endswith(suffix)]

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def status_docs(cap: Capture) -> list[dict[str, Any]]:
    return [json.loads(p) for p in cap.on("/status")]


def stop_process(p: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 15) -> int:
    if p.poll() is None:
        p.send_signal(sig)
    return p.wait(timeout)


def start_host(tmp_path: Any, port: int, name: str = "host") -> "AggregatorThread":
    """A real aggregator storing into ``tmp_path/<name>.db``: the host that acknowledges releases."""
    cfg = host_toml(str(tmp_path / (name + ".toml")), port, str(tmp_path / (name + ".db")), client_id=name)
    return AggregatorThread(cfg)


def pansketch_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "pansketch.host_tools.cli", *args]


wait_for = wait_until
