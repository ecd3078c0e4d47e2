"""deploy/OPERATIONS.md steps 1-2, run as written on Debian's stock mosquitto, then attacked.

tests/support/deploy_ns.py runs inside ``unshare --mount --net`` (a private mount
and network namespace, as root): it bind-mounts a copy of the stock
/etc/mosquitto over /etc/mosquitto, extracts the doc's ```sh blocks of
steps 1 and 2 at run time and runs them with bash (only ``apt-get`` and
``systemctl`` are replaced by their effect), twice (a repeat keeps the CA
and the accounts), then checks that the broker
runs, listens only where the doc says, that the password file is readable
by the ``mosquitto`` user, that a device cannot take over the aggregator's
(or another device's) session nor forge another device's ack, that an
aggregator account cannot publish a release, that the credentials script
refuses colliding names, that the broker got the drop-in's file limit and
max_connections per listener, and that a stranger opening 1,100 idle TCP
connections to 8883 keeps at most the firewall's 20 (deploy/nftables) while
an honest device connects and a TLS agent and aggregator (the configs the
script writes) store a release end to end. /etc is an overlay on a tmpfs
inside the namespace, so the doc's writes there (nftables.conf, the systemd
drop-in) never reach the host.

Skipped, with the reason, when not root, without ``unshare``, or without a
Debian mosquitto package; ``PANSKETCH_REQUIRE_DEPLOY=1`` (set by .ci/run,
which runs as root) turns those skips into failures.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from tests.support.deploy_debian import REPO, _why_not


@pytest.mark.slow
def test_operations_steps_1_2_as_written_on_stock_debian(tmp_path):
    why = _why_not()
    if why:
        if os.environ.get("PANSKETCH_REQUIRE_DEPLOY") == "1":
            pytest.fail("deploy test required (PANSKETCH_REQUIRE_DEPLOY=1) but: " + why)
        pytest.skip(why)
    r = subprocess.run(["unshare", "--mount", "--net", sys.executable, str(REPO / "tests" / "support" / "deploy_ns.py"),
                        str(tmp_path)], capture_output=True, text=True, timeout=400, cwd=REPO)
    out = r.stdout + r.stderr
    checks = [ln for ln in out.splitlines() if ln.startswith("CHECK ")]
    print("\n".join(checks))
    assert r.returncode == 0 and "RESULT ok" in out, out[-6000:]
    names = {ln.split(":")[0][6:] for ln in checks if ": ok" in ln}
    assert names >= {"stock-conf", "doc-steps-1-2", "doc-steps-again", "broker-running", "drop-in", "listeners", "passwd-readable",
                     "acl-users", "name-collisions-refused", "tls", "aggregator-cannot-publish-release",
                     "no-session-takeover", "no-forged-ack", "tls-agent-to-aggregator", "broker-nofile",
                     "max-connections", "strangers-limited", "strangers-held-throughout"}, checks
