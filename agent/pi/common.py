"""What every ``pansketch-agent`` command shares: the program name, exit codes, log lines
on stderr, loading the config (a config error is one line and exit 2).

``gc_held``: :func:`pansketch.agent.pi.daemon.cli` holds the cyclic GC off while modules load;
:meth:`pansketch.agent.pi.loop.Agent.main` turns it back on before counting.
"""

from __future__ import annotations

import sys
import threading
from typing import Any, Callable

PROG = "pansketch-agent"
EXIT_OK, EXIT_UNDELIVERED, EXIT_CONFIG, EXIT_RUNTIME = 0, 1, 2, 3
gc_held = False
SEED_ENV = "PANSKETCH_INSECURE_SEED"


def logger(device: str, quiet: bool = False) -> Callable[[str], None]:
    lock = threading.Lock()
    muted = [quiet]

    def log(msg: str) -> None:
        if muted[0]:
            return
        with lock:
            try:
                sys.stderr.write("%s[%s]: %s\n" % (PROG, device, msg))
                sys.stderr.flush()
            except (OSError, ValueError):  # stderr closed (`feed 2>&1 | head -1`): keep working, silently
                muted[0] = True

    return log


def die(code: int, msg: str) -> int:
    try:
        sys.stderr.write("%s: %s\n" % (PROG, msg))
        sys.stderr.flush()
    except (OSError, ValueError):  # nobody reads stderr any more; the exit code still tells
        pass
    return code


def load_config(path: str) -> Any:
    from pansketch.agent.pi.config import ConfigError, load

    try:
        return load(path)
    except ConfigError as exc:
        raise SystemExit(die(EXIT_CONFIG, "config error: %s" % exc))
