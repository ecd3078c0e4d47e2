"""Shared by tests/test_host_status_gaps.py and the tests that build on it: E0, REPO, status_msg."""

from __future__ import annotations

import json
import os
from tests.support.host import T0


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


E0 = T0 // 3600


def status_msg(device, **kw):
    doc = {"state": "online", "dev": device, "version": "test", "ts": kw.pop("ts", T0), "acked_seq": None,
           "pending": 0, "next_seq": 0, "oldest_pending": None, "rejected": 0, "kind": "cs", "d": 4, "w": 64,
           "mode": "window", "mech": "dgauss", "budget": "1/2", "win_s": 3600, "ep_s": 3600}
    doc.update(kw)
    return "pansketch/%s/status" % device, json.dumps(doc).encode()
