"""A fleet on this machine for the benchmarks (and the end-to-end tests, which import it): the agent
daemon's command line and environment, agent and host TOML for a broker on 127.0.0.1, and the real
aggregator in a thread of this process.

Every agent and host written here shares one fleet salt (``SALT``).
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Optional

# The checkout this package runs from (an editable install): agents started from here import it first.
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SALT = "e2e-fleet-salt"


def agent_env() -> dict[str, str]:
    """This process's environment for an agent subprocess: the checkout first on its PYTHONPATH, and
    never the insecure seed of a test's own environment."""
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.pop("PANSKETCH_INSECURE_SEED", None)
    return env


def agent_cmd(command: str, config: str, *extra: str) -> list[str]:
    """``pansketch-agent COMMAND --config CONFIG EXTRA...`` with this interpreter."""
    return [sys.executable, "-m", "pansketch.agent.pi.daemon", command, "--config", config, *extra]


def agent_toml(path: str, device: str, port: int, state_dir: str, *, window_s: int = 3600, epoch_s: Optional[int] = None,
               mode: str = "window", w: int = 256, d: int = 4, kind: str = "cs", budget: str = "1/2",
               mechanism: str = "dgauss", source: str = 'type = "stdin"', broker_extra: str = "",
               persist_s: int = 60, sketch_extra: str = "", storage_extra: str = "", salt: str = SALT) -> str:
    """Write an agent config for ``device`` publishing to 127.0.0.1:``port`` (reconnects and ack timeouts
    short, as a benchmark or test wants them); returns ``path``."""
    text = """
[broker]
host = "127.0.0.1"
port = %d
reconnect_min_s = 1
reconnect_max_s = 1
ack_timeout_s = 2
%s
[device]
id = "%s"
salt = "%s"
[sketch]
kind = "%s"
d = %d
w = %d
%s
[privacy]
mode = "%s"
mechanism = "%s"
budget = "%s"
window_s = %d
%s
[storage]
dir = "%s"
persist_s = %d
%s
[source]
%s
""" % (port, broker_extra, device, salt, kind, d, w, sketch_extra, mode, mechanism, budget, window_s,
       "epoch_s = %d" % epoch_s if epoch_s else "", state_dir, persist_s, storage_extra, source)
    with open(path, "w") as f:
        f.write(text)
    return path


def host_toml(path: str, port: int, db: str, *, broker_extra: str = "", fleet_extra: str = "",
              client_id: str = "aggregator-test") -> str:
    """Write a host config for an aggregator on 127.0.0.1:``port`` storing into ``db``; returns ``path``."""
    text = """
[broker]
host = "127.0.0.1"
port = %d
client_id = "%s"
reconnect_min_s = 1
reconnect_max_s = 1
%s
[aggregator]
db = "%s"
[fleet]
salt = "%s"
%s
""" % (port, client_id, broker_extra, db, SALT, fleet_extra)
    with open(path, "w") as f:
        f.write(text)
    return path


LIVE: list["AggregatorThread"] = []  # started and not stopped yet (the tests' conftest stops leftovers)


class AggregatorThread:
    """The real aggregator (pansketch.host_tools.ingest.service.run) in a thread, subscribed when constructed."""

    def __init__(self, config_path: str) -> None:
        from pansketch.host_tools import hostconfig
        from pansketch.host_tools.ingest import service

        self.cfg = hostconfig.load(config_path)
        self.stop_ev = threading.Event()
        self.ready = threading.Event()
        self.rc: list[int] = []
        self.thread = threading.Thread(
            target=lambda: self.rc.append(service.run(self.cfg, stop=self.stop_ev, ready=self.ready)),
            name="aggregator", daemon=True)
        self.thread.start()
        LIVE.append(self)
        if not self.ready.wait(15):
            raise RuntimeError("aggregator did not subscribe within 15 s")

    def stop(self) -> int:
        """Stop it and wait for its thread; its exit code (-1 if it had not returned)."""
        self.stop_ev.set()
        self.thread.join(15)
        if self in LIVE:
            LIVE.remove(self)
        return self.rc[0] if self.rc else -1
