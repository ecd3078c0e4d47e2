"""pansketch-agent check --events: expected interval widths and the d/w advice (pansketch.agent.pi.plan.interval_advice)."""

from __future__ import annotations

import subprocess
import sys

from pansketch.agent.pi import plan
from pansketch.agent.params import Params


def _advice(events, **cfg):
    return plan.interval_advice(Params(dict(cfg, device="x", salt="advice-salt")), events)


def test_board_sized_dcs_warns_and_suggests_a_wider_sketch():
    lines = _advice(100_000, kind="dcs", b=32, d=3, w=16)
    assert any(x.startswith("warning") and "dcs" in x for x in lines), lines
    w = int(lines[-1].split("w = ")[1].split(" ")[0])
    # the suggestion meets the target under the same model it warned with
    from pansketch.agent.dcs import exact_from
    assert plan.Z95 * (exact_from(32, w) / w) ** 0.5 <= 0.05 and w > 16


def test_default_configurations_do_not_warn_at_realistic_counts():
    assert not any(x.startswith("warning") for x in _advice(100_000, kind="dcs", b=16, d=4, w=1024))
    assert not any(x.startswith("warning") for x in _advice(100_000, kind="cms"))
    assert not any(x.startswith("warning") for x in _advice(100_000, kind="cs"))


def test_noise_dominates_small_counts():
    lines = _advice(20, kind="cs")
    assert any(x.startswith("warning") for x in lines), lines


def test_dbits_at_default_budget_warns_and_suggests_bits():
    lines = _advice(1_000_000, kind="dbits", d=16, w=1024, mechanism="dlap", budget="1/2")
    assert lines[-1].startswith("warning") and "larger budget" in lines[-1]
    w = int(lines[-1].split("w = ")[1].split(" ")[0])
    assert w % 8 == 0 and plan.Z95 * 3 / (0.5 * w ** 0.5) <= 0.05


def test_check_cli_prints_the_advice(tmp_path):
    conf = tmp_path / "agent.toml"
    conf.write_text('[device]\nid = "pi-1"\nsalt = "advice-salt-1"\n[sketch]\nkind = "dcs"\nd = 3\nw = 16\nb = 32\n'
                    '[storage]\ndir = "state"\n')
    r = subprocess.run([sys.executable, "-m", "pansketch.agent.pi.daemon", "check", "-c", str(conf), "--offline", "--events",
                        "100000"], capture_output=True, text=True, timeout=60)
    assert "uninformative" in r.stdout, (r.stdout, r.stderr)


def test_dcs_resolution_line_names_the_least_squares_capacity():
    """The per-salt intervals solve at most d*w/2 nodes per hashed level (pansketch.host_tools.query.dyadic.LS_MAX_SHARE):
    check says how many readings that resolves, before an answer comes coarsened or with no honest interval."""
    from pansketch.host_tools.query import dyadic

    for d, w in ((4, 1024), (3, 16)):
        lines = _advice(100_000, kind="dcs", b=16, d=d, w=w)
        res = [x for x in lines if x.startswith("resolution")]
        assert res and ("at most %d readings" % int(dyadic.LS_MAX_SHARE * d * w / 2)) in res[0], lines
    assert not any(x.startswith("resolution") for x in _advice(50, kind="dcs", b=16, d=4, w=1024))


def test_check_warns_when_swap_is_on(tmp_path, monkeypatch, capsys):
    """A swap area on a disk keeps what the agent wiped in RAM (docs/PRIVACY.md "Memory residue"):
    `check` says so; a zram swap (RAM) and no swap do not warn."""
    from pansketch.agent.pi import daemon, memwipe
    from tests.support.e2e import agent_toml

    cfg = agent_toml(str(tmp_path / "a.toml"), "swap-dev", 1883, str(tmp_path / "st"))
    swaps = tmp_path / "swaps"
    header = "Filename\t\t\t\tType\t\tSize\t\tUsed\t\tPriority\n"
    for body, warns in (("/var/swap                               file\t\t102396\t\t0\t\t-2\n", True),
                        ("/dev/zram0                              partition\t1015804\t\t0\t\t100\n", False),
                        ("", False)):
        swaps.write_text(header + body)
        monkeypatch.setattr(memwipe, "SWAPS", str(swaps))
        assert daemon.main(["check", "--config", cfg, "--offline"]) == 0
        out = capsys.readouterr()
        assert ("WARNING: swap is on (/var/swap)" in out.err) is warns, out.err
        assert ("swap        on: /var/swap" in out.out) is warns, out.out
    assert memwipe.swap_devices(str(tmp_path / "absent")) == []
