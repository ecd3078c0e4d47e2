"""A store outage does not stop the aggregator: it retries, acknowledges nothing meanwhile, and resumes by itself.

Real PostgreSQL (a throwaway server), real mosquitto, the real aggregator (service.run with its MQTT
process). 20 releases are stored and acknowledged; the server is stopped for longer than 10 s while
20 more are published; the aggregator stays up, acknowledges none of them (neither to the broker nor
to the devices), says so once, and when the server is back stores and acknowledges all 20 without a
restart.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import pytest

from pansketch.host_tools import hostconfig
from pansketch.host_tools.store import pgserver
from pansketch.host_tools.store.backend import open_store
from tests.support.host import SALT, fleet_releases

pytestmark = pytest.mark.skipif(pgserver.binaries() is None, reason=pgserver.MISSING)
OUTAGE_S = 12


def test_aggregator_rides_out_a_postgresql_outage(tmp_path: Any, caplog: Any) -> None:
    import paho.mqtt.client as mqtt

    from tests.support.broker import mosquitto_path, start_mosquitto
    from tests.support.aggregator_mqtt import AggThread, publish_all, wait_for

    if mosquitto_path() is None:
        pytest.skip("mosquitto is not installed (.ci/run installs it)")
    caplog.set_level(logging.WARNING, logger="pansketch")
    srv = pgserver.PgServer.start()
    b = start_mosquitto(tmp_path)
    acks: list[dict[str, Any]] = []
    sub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="ack-watch", protocol=mqtt.MQTTv5)
    sub.on_message = lambda _c, _u, m: acks.append(json.loads(m.payload))
    agg = None
    try:
        dsn = srv.create_database("outage")
        cfg = hostconfig.from_dict({"fleet": {"salt": SALT}, "aggregator": {"db": dsn},
                                    "broker": {"host": "127.0.0.1", "port": b.port}})
        sub.connect("127.0.0.1", b.port)
        sub.subscribe("pansketch/+/ack", qos=1)
        sub.loop_start()
        agg = AggThread(cfg)
        msgs = fleet_releases("po", 4, 10, w=32)
        n_acked = lambda: sum(len(a.get("ok", [])) for a in acks)  # noqa: E731
        publish_all(b.port, msgs[:20])
        wait_for(lambda: n_acked() == 20)

        srv.stop(remove=False)
        publish_all(b.port, msgs[20:])  # the broker has them; the aggregator cannot store them
        time.sleep(OUTAGE_S)
        assert agg.t.is_alive() and not agg.rc, "the aggregator stopped during the outage: rc %s" % agg.rc
        assert n_acked() == 20, "acknowledged during the outage: %d" % (n_acked() - 20)
        down = [r.getMessage() for r in caplog.records if "store is not answering" in r.getMessage()]
        assert len(down) == 1, down  # once per minute, not once per attempt

        srv.restart()
        pgserver.wait_ready(srv.port)
        wait_for(lambda: n_acked() == 40, timeout=60)  # by itself: no restart of the aggregator
        st = open_store(dsn, readonly=True)
        assert st.release_count() == 40
        st.close()
        back = [r.getMessage() for r in caplog.records if "store answers again" in r.getMessage()]
        assert len(back) == 1 and "message(s) stored" in back[0], back  # the group that waited (others queued)
        assert not [r for r in caplog.records if "stopping without acknowledging" in r.getMessage()]
        rc = agg.close()
        agg = None
        assert rc == 0
    finally:
        if agg is not None:
            agg.close()
        sub.disconnect()
        sub.loop_stop()
        b.stop()
        srv.stop()
