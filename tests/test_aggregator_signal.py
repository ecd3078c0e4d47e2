"""The aggregator's SIGINT/SIGTERM handler records the signal and takes no lock.

It runs in the main thread between two bytecodes, possibly while that thread holds a lock:
one that set the stop Event inside the Event's own ``wait`` (which holds the Event's lock)
waited for itself, and the aggregator hung until killed (seen as a benchmark's aggregator
that outlived its SIGTERM by an hour, every thread idle).
"""

from __future__ import annotations

import signal
import threading

from pansketch.host_tools.ingest import service


def test_the_handler_records_the_signal_while_the_stop_event_is_locked():
    signalled: list[int] = []
    handler = service.signal_handler(signalled)
    stop = threading.Event()
    done = threading.Event()

    def interrupted_inside_wait() -> None:
        with stop._cond:  # where Event.wait holds it when the signal lands
            handler(signal.SIGTERM, None)
        done.set()

    t = threading.Thread(target=interrupted_inside_wait, daemon=True)
    t.start()
    assert done.wait(5), "the handler blocked"
    assert signalled == [signal.SIGTERM]
    assert not stop.is_set()  # the main loop turns it into stop (service.run)


def test_the_main_loop_waits_without_the_stop_events_lock():
    import inspect

    src = inspect.getsource(service.run)
    assert "stop.wait(" not in src  # the loop sleeps; a signal handler may then run anywhere in it
    assert "signal_handler(signalled)" in src
