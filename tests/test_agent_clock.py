"""The Pi agent waits for a plausible clock (2024 or later) before it counts or releases, like the firmware.

A Pi without a real-time clock boots at 1970 (or at fake-hwclock's last save); windows opened then
would be released for 1970. The wait is checked with a clock that reads 1970 for its first minutes,
and the agent is checked to wait before its recorder opens a window.
"""

from __future__ import annotations

import argparse

from pansketch.agent.pi import loop


def test_waits_until_the_clock_is_set_and_says_so_once_a_minute():
    clock = loop.Clock()  # the real clock (no --clock-start/--clock-speed)
    t = {"now": 100.0}  # 1970, as after a boot without a real-time clock
    slept: list[float] = []
    logs: list[str] = []

    def sleep(s):
        slept.append(s)
        if len(slept) == 150:  # NTP answers after 150 s
            t["now"] = 1_800_000_000.0

    got = loop.wait_for_plausible_clock(clock, logs.append, now=lambda: t["now"], sleep=sleep)
    assert got == 1_800_000_000 and len(slept) == 150
    waiting = [m for m in logs if "waiting for it" in m]
    assert len(waiting) == 3 and "1970-01-01T00:01:40Z" in waiting[0]  # at 0, 60 and 120 s
    assert logs[-1].startswith("the clock is set")


def test_a_set_clock_and_a_simulated_one_do_not_wait():
    calls = []
    assert loop.wait_for_plausible_clock(loop.Clock(), calls.append, now=lambda: 1_750_000_000.0,
                                         sleep=calls.append) == 1_750_000_000
    sim = loop.Clock(start=1_000_000_000.0, speed=0)  # a test's own time (2001): taken as it is
    assert loop.wait_for_plausible_clock(sim, calls.append, now=lambda: 5.0, sleep=calls.append) == 5
    assert calls == []


def test_the_agent_waits_before_its_recorder_opens_a_window(monkeypatch, tmp_path):
    order: list[str] = []
    monkeypatch.setattr(loop, "wait_for_plausible_clock", lambda clock, log: order.append("wait") or 0)

    def make(*_a, **_k):
        order.append("recorder")
        raise RuntimeError("stop here")

    import pansketch.agent.recorders

    monkeypatch.setattr(pansketch.agent.recorders, "make", make)
    cfg = argparse.Namespace(device="pi-1", params=None, state_dir=str(tmp_path), outbox_max=10)
    args = argparse.Namespace(clock_start=None, clock_speed=1.0, quiet=True, insecure_seed="t", timeout=0)
    try:
        loop.Agent(cfg, args)
    except RuntimeError:
        pass
    assert order == ["wait", "recorder"]
