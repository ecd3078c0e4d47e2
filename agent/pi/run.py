"""``pansketch-agent run`` and ``feed``: start the count workers, then the agent loop."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from pansketch.agent.pi.common import EXIT_CONFIG, EXIT_RUNTIME, die, load_config, logger
from pansketch.agent.pi.loop import Agent


def _stdin_is_devnull() -> bool:
    try:
        a, b = os.fstat(0), os.stat(os.devnull)
    except (OSError, ValueError):
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def cmd_run(args: argparse.Namespace, feed: bool = False) -> int:
    from pansketch.agent.storage import StateError

    cfg = load_config(args.config)
    from pansketch.agent.pi import memwipe
    from pansketch.agent.pi.tomlconf import placeholder_salt_warning

    # before any event is read or a worker forked (it inherits the setting): glibc overwrites
    # what it frees (agent/pi/memwipe.py, docs/PRIVACY.md "Memory residue")
    memwipe.harden()
    if not memwipe.ON and not args.quiet:
        die(0, "WARNING: %s is set: freed memory is not wiped; for the memory tests' negative control only"
            % memwipe.ENV_OFF)
    warning = placeholder_salt_warning("device.salt", cfg.params.salt, "on every device and in host.toml")
    if warning and not args.quiet:
        die(0, "WARNING: " + warning)
    if not feed and cfg.source.type == "stdin" and _stdin_is_devnull():
        return die(EXIT_CONFIG, "config error: source.type: is 'stdin' but standard input is /dev/null "
                    "(a systemd service?); configure a 'file' or 'mqtt' source, or pipe events into 'feed'")
    # count workers first: forked before the recorder loads the noisy state or draws noise, they
    # never hold a copy of either (agent/pi/countworker.py)
    workers = _start_workers(cfg, args) if feed else []
    early = None
    try:
        if workers:
            from pansketch.agent.pi.countworker import Early, read_now
            from pansketch.agent.pi.sources import FdLineReader, Warner

            # what is on standard input already goes to the workers while the modules load and the
            # state boots (pansketch.agent.pi.countworker.Early)
            rd = FdLineReader(Warner(logger(cfg.device, args.quiet)))
            chunks, at_end = read_now(_stdin_fd(), rd, sum(wk.early for wk in workers))
            early = Early(workers, chunks, rd, at_end)
            del chunks
        try:
            agent = Agent(cfg, args, "stdin" if feed else None, workers, early)
        except StateError as exc:
            return die(EXIT_RUNTIME, "state error: %s" % exc)
        except OSError as exc:
            return die(EXIT_RUNTIME, "cannot use state directory %s: %s" % (cfg.state_dir, exc))
        timeout = args.timeout if args.timeout and args.timeout > 0 else None
        return agent.main(timeout)
    finally:
        if early is not None:
            early.stop()  # before any pipe closes
        for wk in workers:
            wk.close()


def _stdin_fd() -> int:
    try:
        return sys.stdin.fileno()
    except (AttributeError, OSError, ValueError):  # no real standard input (the source says so)
        return -1


def _start_workers(cfg: Any, args: argparse.Namespace) -> list[Any]:
    """``feed --jobs N``: N - 1 count worker processes (cms/cs, whose chunks go to pansketch.agent.pi.batch)."""
    p = cfg.params
    jobs = args.jobs
    if jobs is None:
        from pansketch.agent.pi.countworker import default_jobs

        jobs = default_jobs()
    if jobs <= 1 or p.kind not in ("cms", "cs"):
        return []
    # the batch path (numpy) is imported once, before the fork: its pages are shared and a worker
    # counts at once; it holds no state (no noise, no counters) to copy
    import pansketch.agent.pi.batch  # noqa: F401
    from pansketch.agent import hashing
    from pansketch.agent.pi.countworker import CountWorker

    log = logger(cfg.device, args.quiet)
    workers: list[Any] = []
    for _ in range(jobs - 1):
        try:
            workers.append(CountWorker.start(p.kind, p.d, p.w, hashing.salt_prefix(p.salt), p.clip, log, workers))
            workers[-1].wipe_taken = True  # the chunks handed to it are the daemon's own reads
        except OSError as exc:
            log("counting with %d process(es), not %d: cannot start a count worker (%s)"
                % (len(workers) + 1, jobs, exc))
            break
    return workers
