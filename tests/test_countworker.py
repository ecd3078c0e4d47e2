"""``feed --jobs N``: count worker processes (agent/pi/countworker.py).

The workers are real forked processes and the agent is the real daemon: the same cells as counting
in one process, byte-identical releases, at most DEPTH chunks handed to a worker, and a worker that
dies, stops answering or outlives its parent loses nothing and counts nothing twice.
"""

from __future__ import annotations

import argparse
import array
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from pansketch.agent import hashing
from pansketch.agent.pi.batch import add_cells, add_raw
from pansketch.agent.pi.countworker import DEPTH, EARLY, CountWorker, Early, read_now
from pansketch.agent.pi.daemon import build_parser
from pansketch.agent.pi.loop import Agent
from pansketch.agent.pi.run import _start_workers
from pansketch.agent.sketch import Sketch
from pansketch.agent.pi.sources import FdLineReader, Warner
from tests.support.agent_publisher import FROZEN, estimate, outbox
from tests.support.e2e import agent_cmd, agent_env, agent_toml, free_port
from tests.support.feed_chunks import CHUNKS

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="count workers need os.fork")
PREFIX = hashing.salt_prefix("fleet-salt-raw")


def _reference(kind: str, d: int, w: int, chunks: list[bytes]) -> list[int]:
    sk = Sketch(kind, d, w, PREFIX, clip=4)
    for c in chunks:
        add_raw(sk, c, Warner(lambda m: None))
    return list(sk.counters)


@pytest.mark.parametrize("kind,d,w", [("cms", 4, 2048), ("cs", 4, 512), ("cs", 9, 64), ("cms", 2, 33)])
def test_worker_cells_equal_counting_here(kind, d, w):
    """Every kind of line (plain, non-ASCII, invalid UTF-8, TAB weights, CR, empty) gives the
    parent the cells add_raw would have added, into every tree level."""
    wk = CountWorker.start(kind, d, w, PREFIX, 4, lambda m: None, [])
    try:
        sk = Sketch(kind, d, w, PREFIX, clip=4)
        sk.arrays = [sk.counters, array.array("i", bytes(4 * d * w))]
        for c in CHUNKS:
            assert wk.give(c)
            cells = wk.take()
            assert cells is not None and len(cells) == 4 * d * w  # fixed size, whatever the chunk
            add_cells(sk, cells)
            assert cells == bytes(4 * d * w), "the parent's copy of a chunk's cells is zeroed"
        ref = _reference(kind, d, w, CHUNKS)
        assert list(sk.arrays[0]) == ref and list(sk.arrays[1]) == ref
        assert any(ref)
    finally:
        wk.close()


def test_at_most_depth_chunks_in_flight_and_cells_come_back_in_order():
    wk = CountWorker.start("cms", 4, 64, PREFIX, 4, lambda m: None, [])
    try:
        chunks = [b"a\n" * 3, b"b\n" * 5, b"c\n"][:DEPTH]
        for c in chunks:
            assert wk.room()
            assert wk.give(c)
        assert not wk.room()
        with pytest.raises(AssertionError, match="exposure bound"):
            wk.give(b"x\n")
        for c in chunks:
            cells = wk.take()
            assert cells is not None
            assert list(array.array("i", bytes(cells))) == _reference("cms", 4, 64, [c])
        assert wk.room() and not wk.done()
    finally:
        wk.close()


def test_a_second_worker_holds_no_copy_of_the_firsts_pipe():
    """Closing the parent's end ends a worker even when a later-forked worker exists (the later
    one closed its inherited copies)."""
    a = CountWorker.start("cms", 4, 64, PREFIX, 1, lambda m: None, [])
    b = CountWorker.start("cms", 4, 64, PREFIX, 1, lambda m: None, [a])
    try:
        t = time.monotonic()
        a.close()  # waits for the worker's exit: it hangs if b still held a's input pipe open
        assert time.monotonic() - t < 5
    finally:
        b.close()


def _agent(tmp_path, monkeypatch, jobs: int, early_chunks=None, before_early=None):
    """The real daemon's Agent with real workers; ``early_chunks``: the input's start, handed to
    the workers as cmd_run does (pansketch.agent.pi.countworker.Early), after ``before_early(workers)``."""
    monkeypatch.setattr(sys, "stdin", open(os.devnull))  # the stdin source is made, started by the test
    cfg_path = agent_toml(str(tmp_path / ("a%d.toml" % jobs)), "pi-j%d" % jobs, free_port(), str(tmp_path / ("s%d" % jobs)),
                          kind="cs", w=256)
    args = build_parser().parse_args(["feed", "--config", cfg_path, "--jobs", str(jobs), "-q",
                                      "--insecure-seed", "jobs", *FROZEN])
    from pansketch.agent.pi.common import load_config as _load

    cfg = _load(cfg_path)
    workers = _start_workers(cfg, args)
    assert len(workers) == jobs - 1
    early = None
    if early_chunks is not None:
        if before_early is not None:
            before_early(workers)
        early = Early(workers, early_chunks, FdLineReader(), True)  # True: the input ended there
    return Agent(cfg, args, "stdin", workers, early), cfg


def _cells(sk: Sketch) -> list[int]:
    return list(sk.counters)


def test_cells_that_do_not_fit_the_result_pipe_mean_one_chunk_at_a_time():
    """A second chunk is written while the worker may be writing the first one's cells: a sketch
    whose cells outgrow the result pipe would deadlock both, so such a worker takes one at a time."""
    try:
        with open("/proc/sys/fs/pipe-max-size") as f:
            most = int(f.read())
    except OSError:
        pytest.skip("no Linux pipe-max-size here")
    w = 1 << max(1, (most // 16).bit_length())  # d = 4: 4 * 4 * w bytes > most
    big = CountWorker.start("cms", 4, w, PREFIX, 1, lambda m: None, [])
    small = CountWorker.start("cms", 4, 2048, PREFIX, 1, lambda m: None, [big])
    try:
        assert big.nbytes > most and big.depth == 1
        assert small.depth == DEPTH
        assert big.give(b"a\n" * 9) and not big.room()
        cells = big.take()
        assert cells is not None and array.array("i", bytes(cells)).count(9) == 4
    finally:
        small.close()
        big.close()


@pytest.mark.parametrize("how", ["killed", "silent", "stopped-mid-give"])
def test_a_failed_worker_loses_nothing_and_counts_nothing_twice(tmp_path, monkeypatch, how):
    agent, cfg = _agent(tmp_path, monkeypatch, 2)
    try:
        before = _cells(agent.rec.sketch)
        wk = agent.workers[0]
        wk.answer_s = 1.0
        # the agent owns the chunks it is handed and zeroes them once counted (agent.memwipe):
        # fresh copies, as its reads are, and the originals for the reference below
        src = [b"alpha\n" * 7, b"beta\n" * 11, b"gamma\n" * 13]
        a, b, c = (bytes(bytearray(x)) for x in src)
        for _ in range(4):  # more input waits in the queue: the worker is given a second chunk
            agent.q.put(None)
        if how == "stopped-mid-give":  # more than the input pipe holds: the parent waits on a worker
            b = b"".join(b"beta-%d\n" % (i % 1000) for i in range(300_000))  # that reads nothing
            src[1] = bytes(bytearray(b))
            assert len(b) > 2 << 20
            os.kill(wk.pid, signal.SIGSTOP)
            assert agent._hand_over(a)  # into the pipe: in flight, never answered
            t = time.monotonic()
            assert not agent._hand_over(b), "a worker that reads nothing is given up, not waited for"
            assert time.monotonic() - t < 10
            assert agent.workers == [] and not wk.alive
            agent.rec.add_many(b, None, adder=agent._raw_adder)  # the caller counts what it could not hand over
        else:
            assert agent._hand_over(a) and agent._hand_over(b)  # DEPTH = 2: both with the worker
        if wk.alive:
            os.kill(wk.pid, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
        if how == "killed":
            os.waitpid(wk.pid, os.WNOHANG)  # let the kernel close its pipe ends
            time.sleep(0.2)
        if not agent._hand_over(c):  # a dead worker is found here; a silent one is full
            agent.rec.add_many(c, None, adder=agent._raw_adder)
        agent._settle()
        assert agent.workers == [] and not wk.alive
        with pytest.raises(ChildProcessError):
            os.waitpid(wk.pid, os.WNOHANG)  # killed and reaped: it can no longer answer late
        ref = Sketch("cs", 4, 256, hashing.salt_prefix(cfg.params.salt))
        for x in src:
            add_raw(ref, x, Warner(lambda m: None))
        got = [(x - y) & 0xFFFFFFFF for x, y in zip(_cells(agent.rec.sketch), before)]
        assert got == [v & 0xFFFFFFFF for v in ref.counters]
    finally:
        for wk in agent.workers:
            wk.close(kill=True)


def test_chunks_with_a_worker_count_in_the_epoch_they_arrived_in(tmp_path, monkeypatch):
    """A tick first takes the cells of every chunk in flight: a chunk handed over before an epoch
    ends is in that epoch's release, not the next one's."""
    agent, cfg = _agent(tmp_path, monkeypatch, 2)
    try:
        assert agent._hand_over(b"alpha\n" * 5000)
        end = (int(FROZEN[1]) // cfg.params.epoch_s + 1) * cfg.params.epoch_s
        monkeypatch.setattr(agent.clock, "now", lambda: end + 1)
        agent.tick()
        assert not agent.workers[0].chunks
        (rel,) = outbox(str(tmp_path / "s2")).values()
        assert abs(estimate(rel, "alpha") - 5000) < 100  # noise sd about 3 (tests/test_agent_publisher.py)
    finally:
        for wk in agent.workers:
            wk.close(kill=True)


def test_workers_are_forked_before_the_noisy_state_exists(tmp_path, monkeypatch):
    """The pan-privacy of the fork: no worker may hold a copy of the state or of any noise."""
    import pansketch.agent.pi.countworker
    import pansketch.agent.pi.run
    import pansketch.agent.recorders

    order: list[str] = []
    start, make = pansketch.agent.pi.countworker.CountWorker.start, pansketch.agent.recorders.make

    def forked(*a, **k):
        order.append("fork")
        return start(*a, **k)

    def state(*a, **k):
        order.append("state")
        return make(*a, **k)

    monkeypatch.setattr(pansketch.agent.pi.countworker.CountWorker, "start", forked)
    monkeypatch.setattr(pansketch.agent.recorders, "make", state)
    monkeypatch.setattr(sys, "stdin", open(os.devnull))
    cfg = agent_toml(str(tmp_path / "o.toml"), "pi-o", free_port(), str(tmp_path / "so"), kind="cms", w=64)
    args = build_parser().parse_args(["feed", "--config", cfg, "--jobs", "3", "--timeout", "0.2", "-q", *FROZEN])
    assert pansketch.agent.pi.run.cmd_run(args, feed=True) == 1  # undelivered: no broker
    assert order == ["fork", "fork", "state"]


def _feed(tmp_path, jobs: int, data: bytes, state: str) -> subprocess.CompletedProcess:
    cfg = agent_toml(str(tmp_path / ("f%d.toml" % jobs)), "pi-f", free_port(), state, kind="cs", w=512,
                     sketch_extra="clip = 2")
    # no broker: the release stays in the outbox (exit 1), where its bytes can be compared
    return subprocess.run(agent_cmd("feed", cfg, "--jobs", str(jobs), "--timeout", "0.5", "--insecure-seed", "same",
                                    *FROZEN), input=data, env=agent_env(), capture_output=True, timeout=120)


def test_feed_with_two_processes_commits_the_same_release_bytes(tmp_path):
    # 5 chunks' worth of lines (CHUNK_LINES = 32,768), with weighted (clip 2) and non-ASCII lines all through
    odd = [b"w\t3", b"v\t-5", "café".encode(), b"\xff", b"cr\r"]
    lines = [b"dev-%d" % (i * 7919 % 5003) if i % 97 else odd[i % 5] for i in range(160_000)]
    data = b"\n".join(lines) + b"\n"
    outs = {}
    for jobs in (1, 2):
        r = _feed(tmp_path, jobs, data, str(tmp_path / ("st%d" % jobs)))
        assert r.returncode == 1, r.stderr  # undelivered (no broker), committed to the outbox
        outs[jobs] = outbox(str(tmp_path / ("st%d" % jobs)))
        assert len(outs[jobs]) == 1
    m = re.search(rb"counted (\d+) input chunk\(s\), (\d+) of them in 1 helper", r.stderr)
    assert m and int(m.group(1)) >= 5 and int(m.group(2)) >= 1, r.stderr[-2000:]
    assert outs[1] == outs[2]
    r = _feed(tmp_path, 2, data[:-len(b"dev-0\n") * 10], str(tmp_path / "other"))
    assert outbox(str(tmp_path / "other")) != outs[2], "the comparison sees the counts"


def test_a_worker_ends_with_its_parent(tmp_path):
    cfg = agent_toml(str(tmp_path / "k.toml"), "pi-k", free_port(), str(tmp_path / "sk"), kind="cms", w=256)
    p = subprocess.Popen(agent_cmd("feed", cfg, "--jobs", "2", "-q"), stdin=subprocess.PIPE, env=agent_env(),
                         stderr=subprocess.DEVNULL)
    try:
        kids: list[int] = []
        deadline = time.monotonic() + 20
        while not kids and time.monotonic() < deadline:
            try:
                with open("/proc/%d/task/%d/children" % (p.pid, p.pid)) as f:
                    kids = [int(x) for x in f.read().split()]
            except OSError:
                pytest.skip("no /proc children list here")
            time.sleep(0.05)
        assert kids, "feed --jobs 2 started no worker"
        p.stdin.write(b"x\n" * 1000)
        p.stdin.flush()
        p.kill()
        p.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and all(os.path.exists("/proc/%d" % k) and _alive(k) for k in kids):
            time.sleep(0.05)
        assert not any(_alive(k) for k in kids), "a worker outlived its killed parent"
    finally:
        if p.poll() is None:
            p.kill()


def _alive(pid: int) -> bool:
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("bad", ["0", "x", "65"])
def test_bad_jobs_is_a_one_line_usage_error(tmp_path, bad):
    r = subprocess.run([sys.executable, "-m", "pansketch.agent.pi.daemon", "feed", "--config", "x.toml", "--jobs", bad],
                       env=agent_env(), capture_output=True, timeout=60)
    assert r.returncode == 2
    assert len(r.stderr.decode().strip().splitlines()) == 1 and "--jobs" in r.stderr.decode()


def test_parser_default_leaves_the_choice_to_the_machine():
    a = build_parser().parse_args(["feed", "--config", "x"])
    assert isinstance(a, argparse.Namespace) and a.jobs is None


def test_closing_a_stopped_idle_worker_does_not_hang():
    wk = CountWorker.start("cms", 4, 64, PREFIX, 1, lambda m: None, [])
    os.kill(wk.pid, signal.SIGSTOP)
    t = time.monotonic()
    wk.close(grace_s=0.5)  # its input closed, but a stopped process never reads the end
    assert time.monotonic() - t < 5
    with pytest.raises(ChildProcessError):
        os.waitpid(wk.pid, os.WNOHANG)  # killed and reaped


def test_the_entry_point_counts_with_the_collector_on_and_exits_with_mains_status(tmp_path):
    """pansketch.agent.pi.daemon.cli holds the cyclic GC off while modules load and skips the interpreter's
    teardown (os._exit): the pump and the count workers must run with the collector on again,
    and the exit status and the output must be main()'s."""
    cfg = agent_toml(str(tmp_path / "g.toml"), "pi-g", free_port(), str(tmp_path / "sg"), kind="cms", w=64)
    code = (
        "import gc, os, sys\n"
        "import pansketch.agent.pi.batch as b, pansketch.agent.pi.daemon as d, pansketch.agent.pi.loop as lp\n"
        "pump, add_raw = lp.Agent.pump, b.add_raw\n"
        "def p(self):\n"
        "    print('pump gc', gc.isenabled(), flush=True)\n"
        "    return pump(self)\n"
        "def a(sk, data, warn):\n"
        "    print('count gc', gc.isenabled(), 'in', os.getpid(), flush=True)\n"
        "    add_raw(sk, data, warn)\n"
        "lp.Agent.pump, b.add_raw = p, a\n"
        "print('before', gc.isenabled(), 'main', os.getpid())\n"  # buffered: cli() must flush it
        "sys.argv = ['pansketch-agent', 'feed', '--config', %r, '--jobs', '2', '--timeout', '0.2', '-q']\n"
        "d.cli()\n" % cfg)
    r = subprocess.run([sys.executable, "-c", code], input=b"x\n" * 10, env=agent_env(), capture_output=True,
                       timeout=120)
    assert r.returncode == 1, r.stderr  # main()'s status: undelivered (no broker)
    out = r.stdout.decode()
    assert "before True" in out and "pump gc True" in out
    main_pid = re.search(r"main (\d+)", out).group(1)
    counted = re.findall(r"count gc (\w+) in (\d+)", out)
    assert counted and all(on == "True" for on, _ in counted), out
    assert any(pid != main_pid for _, pid in counted), "the worker counted (with its collector on)"



def _reference_of(cfg, chunks) -> list[int]:
    ref = Sketch("cs", 4, 256, hashing.salt_prefix(cfg.params.salt))
    for x in chunks:
        add_raw(ref, x, Warner(lambda m: None))
    return [v & 0xFFFFFFFF for v in ref.counters]


@pytest.mark.parametrize("how", ["ok", "killed-before", "stopped-before", "killed-after"])
def test_the_input_start_handed_over_early_counts_once_whatever_the_worker_does(tmp_path, monkeypatch, how):
    """The input's start is read and handed to the workers while the main process starts; the
    pump takes it before its queue. A worker that is dead or not reading when the chunks are
    written, or that dies holding them, loses nothing and counts nothing twice."""
    chunks = [b"e%d-%d\n" % (i, j % 50) * 1 for i in range(EARLY + 3) for j in range(200)]
    chunks = [b"".join(chunks[i * 200:(i + 1) * 200]) for i in range(EARLY + 3)]  # more than a worker may take
    chunks[1] = b"".join(b"big-%d\n" % (i % 999) for i in range(300_000))  # more than its input pipe holds

    def before(workers):
        for wk in workers:
            wk.answer_s = 1.0
            if how == "killed-before":
                os.kill(wk.pid, signal.SIGKILL)
            elif how == "stopped-before":
                os.kill(wk.pid, signal.SIGSTOP)

    # the agent owns (and zeroes once counted) the chunks it reads: it gets copies
    agent, cfg = _agent(tmp_path, monkeypatch, 2, [bytes(bytearray(c)) for c in chunks], before)
    wk = agent.workers[0]
    try:
        assert [type(x).__name__ for x in agent.pre] == ["Ticket"] * EARLY + ["bytes"] * 3
        before_cells = _cells(agent.rec.sketch)
        if how == "killed-after":
            agent.early.thread.join(10)
            assert not agent.early.busy() and all(t.ok for t in agent.pre[:EARLY])
            os.kill(wk.pid, signal.SIGKILL)  # holding every early chunk, answered or not
        tickets = [t for t in agent.pre if type(t).__name__ == "Ticket"]
        agent.source.start()  # resumed at the input's end: only EOF comes
        assert agent.pump() is True
        got = [(x - y) & 0xFFFFFFFF for x, y in zip(_cells(agent.rec.sketch), before_cells)]
        assert got == _reference_of(cfg, chunks)
        assert not agent.pre and agent.early.items == [] and not agent.early.busy()  # nothing kept
        if how == "ok":  # the worker really counted them
            assert all(t.ok for t in tickets) and agent.chunks_handed >= EARLY
        if how != "ok":
            with pytest.raises(ChildProcessError):
                os.waitpid(wk.pid, os.WNOHANG)  # killed and reaped: it can no longer answer late
    finally:
        for w in agent.workers:
            w.close(kill=True)


def test_read_now_takes_only_what_is_there(tmp_path):
    r, w = os.pipe()
    try:
        os.write(w, b"a\nb\npart")
        rd = FdLineReader()
        t = time.monotonic()
        chunks, ended = read_now(r, rd, 8)
        assert time.monotonic() - t < 1, "it must not wait for more input"
        assert chunks == [b"a\nb\n"] and not ended and rd.rest == b"part"
        os.write(w, b"ial\n")
        os.close(w)
        w = -1
        chunks, ended = read_now(r, rd, 8)
        assert chunks == [b"partial\n"] and ended
        assert read_now(-1, FdLineReader(), 8) == ([], False)  # no usable stdin: the source reports it
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)


def test_a_start_that_fails_while_the_input_is_handed_over_exits_cleanly(tmp_path):
    """The state directory cannot be made: the feed says so and exits 3 at once, with the
    early hand-over stopped and its workers gone (not waiting on a write nobody reads)."""
    (tmp_path / "file").write_text("")
    cfg = agent_toml(str(tmp_path / "x.toml"), "pi-x", free_port(), str(tmp_path / "file" / "state"), kind="cs", w=256)
    data = tmp_path / "in.txt"
    data.write_bytes(b"".join(b"dev-%d\n" % (i % 7000) for i in range(1_500_000)))  # many chunks: the hand-over waits
    with open(data, "rb") as f:
        t = time.monotonic()
        r = subprocess.run(agent_cmd("feed", cfg, "--jobs", "2"), stdin=f, env=agent_env(), capture_output=True,
                           timeout=60)
    assert r.returncode == 3, r.stderr
    assert b"state directory" in r.stderr
    assert time.monotonic() - t < 20



def test_a_stop_while_the_input_start_is_handed_over_ends_promptly(tmp_path, monkeypatch):
    """SIGTERM while the early hand-over waits on a worker that does not read: the pump returns
    at once, the hand-over is ended before any pipe closes, the workers are gone."""
    chunks = [b"".join(b"s-%d\n" % (i % 999) for i in range(300_000))] * 3  # each more than the pipe holds

    def stopped(workers):
        for wk in workers:
            os.kill(wk.pid, signal.SIGSTOP)

    agent, cfg = _agent(tmp_path, monkeypatch, 2, chunks, stopped)
    wk = agent.workers[0]
    try:
        assert agent.early.busy()
        agent.stopping.set()
        t = time.monotonic()
        assert agent.pump() is False
        assert time.monotonic() - t < 10
        assert not agent.early.busy() and agent.pre == [] and agent.workers == []
        with pytest.raises(ChildProcessError):
            os.waitpid(wk.pid, os.WNOHANG)
    finally:
        for w in agent.workers:
            w.close(kill=True)
