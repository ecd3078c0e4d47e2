"""A real three-node RabbitMQ cluster (Debian's rabbitmq-server) on loopback ports, for tests and benchmarks.

    from tests.support.rabbit import needs_rabbitmq, start_cluster
    c = start_cluster(tmp_path, devices=["dev0", "dev1"])   # .nodes[i].amqp_port/.mqtt_port, .kill(i), .stop()

Each node has its own node name, AMQP/MQTT/distribution ports, data dir and
log dir; the cluster has a private Erlang cookie (``HOME`` of the nodes and of
``rabbitmqctl`` is the cluster's own directory). The package's server
script is run directly (``/usr/lib/rabbitmq/bin/rabbitmq-server``; its
``sbin`` wrapper would switch to the ``rabbitmq`` user and that user's
cookie). Startup: the three nodes boot in parallel, then nodes 2 and 3 join
node 1 (``stop_app``, ``join_cluster``, ``start_app``), then
every node's MQTT client-id tracker (the Ra cluster ``mqtt_node``) is checked
to hold all three nodes; a node left out is restarted (``stop_app`` /
``start_app``), which is what a parallel start sometimes needs.

Users and permissions come from a definitions file loaded by node 1 at boot
(:func:`definitions`, the same rules as deploy/rabbitmq/setup.sh): a device
user per device, an aggregator user, and the policy that mirrors device
session queues (``^mqtt-subscription-``) so a device whose node dies resumes
its session on another node.

Tests using it are skipped, with the reason, only outside CI when
rabbitmq-server is not installed (``.ci/run`` installs it; in CI a missing
server fails).
"""

from __future__ import annotations

import base64
import concurrent.futures
import hashlib
import json
import os
import shutil
import signal
import subprocess
import time
import uuid
from typing import Any, Optional, Sequence

import pytest

from tests.support.broker import free_port

SERVER = "/usr/lib/rabbitmq/bin/rabbitmq-server"
CTL = "/usr/lib/rabbitmq/bin/rabbitmqctl"
AGG_USER, AGG_PASSWORD = "pansketch-aggregator", "agg-secret"


def rabbitmq_path() -> Optional[str]:
    return SERVER if os.path.exists(SERVER) and os.path.exists(CTL) else None


def _skip_reason() -> Optional[str]:
    if rabbitmq_path() is not None:
        return None
    if os.environ.get("CI"):
        return None  # in CI a missing server is a failure, not a skip
    return "rabbitmq-server is not installed (.ci/run installs it: apt-get install rabbitmq-server)"


needs_rabbitmq = pytest.mark.skipif(_skip_reason() is not None, reason=_skip_reason() or "")


def device_password(dev: str) -> str:
    return "pw-" + dev


def _hash(password: str) -> str:
    """rabbit_password_hashing_sha256: base64(salt(4) + sha256(salt + password))."""
    salt = os.urandom(4)
    return base64.b64encode(salt + hashlib.sha256(salt + password.encode()).digest()).decode()


def definitions(devices: Sequence[str], prefix: str = "pansketch") -> dict[str, Any]:
    """Users, permissions, topic permissions and policies (the mosquitto ACL's rules; deploy/rabbitmq/setup.sh).

    A device may create/consume only its own MQTT session queues, publish
    (topic permission ``write``) only ``<prefix>.<itself>.release``/``status``
    and subscribe (``read``) only ``<prefix>.<itself>.ack``. The aggregator
    consumes queues named ``<prefix>.*`` and publishes acks.
    """
    users = [{"name": AGG_USER, "password_hash": _hash(AGG_PASSWORD),
              "hashing_algorithm": "rabbit_password_hashing_sha256", "tags": ""}]
    perms = [{"user": AGG_USER, "vhost": "/", "configure": "^%s\\." % prefix,
              "write": "^(amq\\.topic|%s\\..*)$" % prefix, "read": "^(amq\\.topic|%s\\..*)$" % prefix}]
    tperms = [{"user": AGG_USER, "vhost": "/", "exchange": "amq.topic",
               "write": "^%s\\.[^.]+\\.ack$" % prefix, "read": "^%s\\.[^.]+\\.(release|status)$" % prefix}]
    for d in devices:
        users.append({"name": d, "password_hash": _hash(device_password(d)),
                      "hashing_algorithm": "rabbit_password_hashing_sha256", "tags": ""})
        q = "^mqtt-subscription-%sqos[01]$" % d
        perms.append({"user": d, "vhost": "/", "configure": q, "write": "^amq\\.topic$|" + q,
                      "read": "^amq\\.topic$|" + q})
        tperms.append({"user": d, "vhost": "/", "exchange": "amq.topic",
                       "write": "^%s\\.%s\\.(release|status)$" % (prefix, d),
                       "read": "^%s\\.%s\\.ack$" % (prefix, d)})
    return {"users": users, "vhosts": [{"name": "/"}], "permissions": perms, "topic_permissions": tperms,
            "policies": [{"vhost": "/", "name": "mqtt-sessions", "pattern": "^mqtt-subscription-",
                          "apply-to": "queues", "priority": 0,
                          "definition": {"ha-mode": "all", "ha-sync-mode": "automatic"}}]}


class Node:
    def __init__(self, base: str, name: str, tls: Optional[dict[str, Any]]) -> None:
        self.name = name
        self.dir = os.path.join(base, name.split("@")[0])
        self.amqp_port = free_port()
        self.mqtt_port = free_port()
        self.dist_port = free_port()
        self.mqtts_port = free_port() if tls else None
        self.amqps_port = free_port() if tls else None
        self.proc: Optional[subprocess.Popen[bytes]] = None


class Cluster:
    """Three RabbitMQ nodes clustered on loopback; see the module docstring."""

    def __init__(self, tmpdir: Any, devices: Sequence[str] = (), n: int = 3, tls: Optional[dict[str, Any]] = None,
                 timeout: float = 150.0) -> None:
        self.base = str(tmpdir)
        self.home = os.path.join(self.base, "home")
        os.makedirs(self.home, exist_ok=True)
        cookie = os.path.join(self.home, ".erlang.cookie")
        with open(cookie, "w") as f:
            f.write(uuid.uuid4().hex.upper())
        os.chmod(cookie, 0o400)
        tag = uuid.uuid4().hex[:6]
        self.tls = tls
        self.nodes = [Node(self.base, "psk%s-%d@localhost" % (tag, i + 1), tls) for i in range(n)]
        self.timeout = timeout
        with open(os.path.join(self.base, "definitions.json"), "w") as f:
            json.dump(definitions(devices), f)
        with open(os.path.join(self.base, "enabled_plugins"), "w") as f:
            f.write("[rabbitmq_mqtt].\n")
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    # -- processes ----------------------------------------------------------
    def _env(self, node: Node) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RABBITMQ_")}
        env.update(HOME=self.home, RABBITMQ_NODENAME=node.name, RABBITMQ_USE_LONGNAME="false",
                   RABBITMQ_NODE_IP_ADDRESS="127.0.0.1", RABBITMQ_NODE_PORT=str(node.amqp_port),
                   RABBITMQ_DIST_PORT=str(node.dist_port), RABBITMQ_MNESIA_BASE=os.path.join(node.dir, "mnesia"),
                   RABBITMQ_LOG_BASE=os.path.join(node.dir, "log"),
                   RABBITMQ_CONFIG_FILE=os.path.join(node.dir, "rabbitmq.conf"),
                   RABBITMQ_ADVANCED_CONFIG_FILE=os.path.join(node.dir, "advanced.config"),
                   RABBITMQ_ENABLED_PLUGINS_FILE=os.path.join(self.base, "enabled_plugins"),
                   RABBITMQ_PID_FILE=os.path.join(node.dir, "pid"),
                   RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1}",
                   # the Erlang VM's schedulers: the machine is shared (2 cores)
                   RABBITMQ_SERVER_ERL_ARGS="+P 1048576 +t 5000000 +stbt db +zdbbl 128000 +S 2:2 +sbwt none "
                                            "+sbwtdcpu none +sbwtdio none")
        return env

    def _conf(self, node: Node, first: bool) -> str:
        lines = ["listeners.tcp.default = 127.0.0.1:%d" % node.amqp_port,
                 "mqtt.listeners.tcp.default = 127.0.0.1:%d" % node.mqtt_port,
                 "mqtt.allow_anonymous = false",
                 "mqtt.vhost = /", "mqtt.exchange = amq.topic",
                 "loopback_users = none",
                 "log.file.level = info", "log.console = false",
                 "cluster_partition_handling = pause_minority",
                 "disk_free_limit.absolute = 50MB",
                 "vm_memory_high_watermark.relative = 0.6"]
        if first:
            lines.append("load_definitions = %s" % os.path.join(self.base, "definitions.json"))
        if self.tls and node.mqtts_port:
            lines += ["mqtt.listeners.ssl.default = 127.0.0.1:%d" % node.mqtts_port,
                      "listeners.ssl.default = 127.0.0.1:%d" % node.amqps_port,
                      "ssl_options.cacertfile = %s" % self.tls["cafile"],
                      "ssl_options.certfile = %s" % self.tls["certfile"],
                      "ssl_options.keyfile = %s" % self.tls["keyfile"],
                      "ssl_options.verify = verify_peer",
                      "ssl_options.fail_if_no_peer_cert = false",
                      "ssl_options.versions.1 = tlsv1.2", "ssl_options.versions.2 = tlsv1.3"]
        return "\n".join(lines) + "\n"

    def _spawn(self, node: Node, first: bool) -> None:
        os.makedirs(os.path.join(node.dir, "log"), exist_ok=True)
        with open(os.path.join(node.dir, "rabbitmq.conf"), "w") as f:
            f.write(self._conf(node, first))
        with open(os.path.join(node.dir, "advanced.config"), "w") as f:
            f.write("[].\n")
        out = open(os.path.join(node.dir, "stdout.log"), "ab")
        node.proc = subprocess.Popen([SERVER], env=self._env(node), stdout=out, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True,
                                     cwd=node.dir)  # Mnesia core dumps land in the node's cwd, not the checkout
        out.close()

    def ctl(self, node: Node, *args: str, timeout: float = 60.0, check: bool = True) -> str:
        r = subprocess.run([CTL, "-n", node.name, *args], env=self._env(node), capture_output=True, text=True,
                           timeout=timeout, cwd=node.dir)
        if check and r.returncode != 0:
            raise RuntimeError("rabbitmqctl %s on %s: %s%s" % (" ".join(args), node.name, r.stdout, r.stderr))
        return r.stdout

    def eval(self, node: Node, expr: str, timeout: float = 60.0) -> str:
        return self.ctl(node, "eval", expr, timeout=timeout).strip()

    def _await(self, node: Node, deadline: float) -> None:
        while True:
            if node.proc is not None and node.proc.poll() is not None:
                raise RuntimeError("rabbitmq node %s exited (%s): %s" % (node.name, node.proc.returncode,
                                                                       self.log_tail(node)))
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("rabbitmq node %s did not start: %s" % (node.name, self.log_tail(node)))
            r = subprocess.run([CTL, "-n", node.name, "await_startup", "--timeout", str(int(max(5, left)))],
                               env=self._env(node), capture_output=True, text=True, timeout=left + 30)
            if r.returncode == 0:
                return
            time.sleep(0.5)

    def _start(self) -> None:
        t0 = time.monotonic()
        deadline = t0 + self.timeout
        for i, node in enumerate(self.nodes):
            self._spawn(node, i == 0)
        with concurrent.futures.ThreadPoolExecutor(len(self.nodes)) as ex:
            list(ex.map(lambda n: self._await(n, deadline), self.nodes))
        first = self.nodes[0]

        def app(n: Node, action: str) -> None:
            self.ctl(n, action, timeout=max(30.0, deadline - time.monotonic()))

        with concurrent.futures.ThreadPoolExecutor(len(self.nodes)) as ex:
            list(ex.map(lambda n: app(n, "stop_app"), self.nodes[1:]))
        # one join at a time: two nodes joining at once can abort each other's Mnesia schema
        # transaction (`{aborted, {shutdown, ... sync_dump_log, schema_prepare}}`, seen in CI)
        for n in self.nodes[1:]:
            self.ctl(n, "join_cluster", first.name, timeout=max(30.0, deadline - time.monotonic()))
        with concurrent.futures.ThreadPoolExecutor(len(self.nodes)) as ex:
            list(ex.map(lambda n: app(n, "start_app"), self.nodes[1:]))
        self.ensure_mqtt_members(deadline)
        self.started_s = time.monotonic() - t0

    def mqtt_members(self, node: Node) -> set[str]:
        out = self.eval(node, "ra:members({mqtt_node, node()}).")
        return {n for n in (x.name for x in self.nodes) if "'%s'" % n in out or n in out}

    def ensure_mqtt_members(self, deadline: Optional[float] = None) -> None:
        """Every running node's MQTT client-id tracker holds every running node; restart a node's app if not."""
        deadline = deadline or time.monotonic() + 60
        want = {n.name for n in self.running_nodes()}
        while True:
            short = [n for n in self.running_nodes() if not want <= self._members_or_empty(n)]
            if not short:
                return
            if time.monotonic() > deadline:
                raise TimeoutError("MQTT client-id cluster incomplete on %s" % [n.name for n in short])
            for n in short:
                time.sleep(1.0)
                if not want <= self._members_or_empty(n):
                    self.ctl(n, "stop_app")
                    self.ctl(n, "start_app")

    def _members_or_empty(self, node: Node) -> set[str]:
        try:
            return self.mqtt_members(node)
        except Exception:
            return set()

    def running_nodes(self) -> list[Node]:
        return [n for n in self.nodes if n.proc is not None and n.proc.poll() is None]

    # -- queue leader -------------------------------------------------------
    def queue_leader(self, queue: str) -> Node:
        out = self.eval(self.running_nodes()[0],
                        "{ok, Q} = rabbit_amqqueue:lookup(rabbit_misc:r(<<\"/\">>, queue, <<\"%s\">>)), "
                        "amqqueue:get_pid(Q)." % queue)
        for n in self.nodes:
            if n.name in out:
                return n
        raise RuntimeError("leader of %s not found in %r" % (queue, out))

    # -- faults -------------------------------------------------------------
    def kill(self, i: int) -> None:
        """``kill -9`` node i (the Erlang VM and its children: its process group)."""
        node = self.nodes[i]
        if node.proc is not None and node.proc.poll() is None:
            try:
                os.killpg(node.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            node.proc.wait(30)

    def restart(self, i: int) -> None:
        node = self.nodes[i]
        self._spawn(node, False)
        self._await(node, time.monotonic() + self.timeout)

    def stop(self) -> None:
        for i in range(len(self.nodes)):
            self.kill(i)

    def log_tail(self, node: Node, n: int = 3000) -> str:
        text = ""
        for d in (node.dir, os.path.join(node.dir, "log")):
            if not os.path.isdir(d):
                continue
            for f in sorted(os.listdir(d)):
                if f.endswith(".log"):
                    with open(os.path.join(d, f), errors="replace") as fh:
                        text += "\n--- %s\n%s" % (f, fh.read()[-n:])
        return text

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def start_cluster(tmpdir: Any, devices: Sequence[str] = (), n: int = 3, tls: Optional[dict[str, Any]] = None,
                  timeout: float = 150.0) -> Cluster:
    if rabbitmq_path() is None:
        if os.environ.get("CI"):
            raise RuntimeError("rabbitmq-server is not installed (.ci/run should have installed it)")
        pytest.skip("rabbitmq-server is not installed")
    if shutil.which("epmd") is None and not os.path.exists("/usr/lib/erlang/bin/epmd"):
        pytest.skip("epmd (erlang-base) is missing")
    # a port picked free can be taken by a parallel test before the node binds it (eaddrinuse):
    # a cluster that failed that way has stopped its nodes; it is started again on fresh ports
    for attempt in range(3):
        try:
            return Cluster(os.path.join(str(tmpdir), "try%d" % attempt) if attempt else tmpdir, devices, n, tls,
                           timeout)
        except RuntimeError as e:
            if "eaddrinuse" not in str(e) or attempt == 2:
                raise
    raise AssertionError("unreachable")


class Balancer:
    """A TCP front for the cluster's MQTT listeners (what HAProxy or DNS does in deploy/rabbitmq): each new
    connection goes to the next node that accepts it, so a device whose node died reconnects to another."""

    def __init__(self, ports: Sequence[int]) -> None:
        import socket
        import threading

        self.ports = list(ports)
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(128)
        self.port = self.sock.getsockname()[1]
        self._next = 0
        self._closed = False
        self._conns: list[Any] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket
        import threading

        while not self._closed:
            try:
                c, _a = self.sock.accept()
            except OSError:
                return
            up = None
            for k in range(len(self.ports)):
                port = self.ports[(self._next + k) % len(self.ports)]
                try:
                    up = socket.create_connection(("127.0.0.1", port), timeout=2)
                    up.settimeout(None)
                    self._next = (self._next + k + 1) % len(self.ports)
                    break
                except OSError:
                    continue
            if up is None:
                c.close()
                continue
            self._conns += [c, up]
            for a, b in ((c, up), (up, c)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(a: Any, b: Any) -> None:
        import socket

        try:
            while True:
                data = a.recv(65536)
                if not data:
                    break
                b.sendall(data)
        except OSError:
            pass
        for s in (a, b):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self._closed = True
        self.sock.close()
        for s in self._conns:
            try:
                s.close()
            except OSError:
                pass
