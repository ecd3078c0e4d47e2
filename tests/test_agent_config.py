"""Agent TOML config: valid files map onto Params; every error names its key, exit 2."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pansketch.agent.pi import config as agent_config
from pansketch.agent.pi.config import ConfigError
from pansketch.agent.pi.daemon import main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BASE = """
[broker]
host = "127.0.0.1"
port = 1883
[device]
id = "pi-1"
salt = "fleet-salt-1"
[sketch]
kind = "cms"
d = 3
w = 512
clip = 2
[privacy]
mode = "keep"
mechanism = "dlap"
budget = "1/4"
window_s = 3600
epoch_s = 900
[storage]
dir = "st"
persist_s = 30
"""


def write(tmp_path, text: str, name: str = "agent.toml") -> str:
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_example_config_is_valid():
    cfg = agent_config.load(os.path.join(REPO, "examples", "agent.toml"))
    assert cfg.params.device == "pi-kitchen"
    assert (cfg.params.kind, cfg.params.d, cfg.params.w) == ("cs", 4, 2048)
    assert cfg.source.type == "stdin"
    assert cfg.topic("release") == "pansketch/pi-kitchen/release"


def test_keys_map_onto_params(tmp_path):
    cfg = agent_config.load(write(tmp_path, BASE))
    p = cfg.params
    assert (p.device, p.salt, p.kind, p.d, p.w, p.clip) == ("pi-1", "fleet-salt-1", "cms", 3, 512, 2)
    assert (p.mode, p.mechanism, p.budget, p.window_s, p.epoch_s, p.persist_s) == ("keep", "dlap", (1, 4), 3600, 900, 30)
    # relative storage dir is relative to the config file, not the cwd
    assert cfg.state_dir == str(tmp_path / "st")
    assert cfg.broker.tls is None and cfg.broker.port == 1883


def test_tls_and_password_file(tmp_path):
    (tmp_path / "ca.crt").write_text("x")
    (tmp_path / "pw").write_text("s3cret\n")
    text = BASE.replace('port = 1883\n', 'tls_ca = "ca.crt"\nusername = "pi-1"\npassword_file = "pw"\n')
    cfg = agent_config.load(write(tmp_path, text))
    assert cfg.broker.tls is not None and cfg.broker.tls.ca == str(tmp_path / "ca.crt")
    assert cfg.broker.port == 8883  # TLS default port
    assert cfg.broker.password == "s3cret"


BAD = [
    # (replace this, with that, expected key, words in the message)
    ('budget = "1/4"', 'budget = "0"', "privacy.budget", "must be positive"),
    ('budget = "1/4"', "budget = 0.25", "privacy.budget", "string"),
    ('budget = "1/4"', 'budget = "abc"', "privacy.budget", "decimal"),
    ("w = 512", "w = 1", "sketch.w", "between"),
    ("d = 3", 'd = "3"', "sketch.d", "integer"),
    ('kind = "cms"', 'kind = "bloom"', "sketch.kind", "'cms', 'cs', 'dcs', 'dbits' or 'strhh'"),
    ("epoch_s = 900", "epoch_s = 700", "privacy.epoch_s", "divide"),
    ('mode = "keep"', 'mode = "binary"', "privacy.mode", "window"),
    ('mechanism = "dlap"', 'mechanism = "laplace"', "privacy.mechanism", "dlap"),
    ('id = "pi-1"', 'id = "pi 1"', "device.id", "letters"),
    ('id = "pi-1"\n', "", "device.id", "required"),
    ('salt = "fleet-salt-1"', 'salt = "short"', "device.salt", "8 characters"),
    ('dir = "st"', 'dir = ""', "storage.dir", "required"),
    ("persist_s = 30", "persist_s = 0", "storage.persist_s", "between"),
    ("port = 1883", "port = 70000", "broker.port", "65535"),
    ("port = 1883", "prot = 1883", "broker.prot", "unknown key"),
    ("[storage]", "[storage]\n[extra]", "extra", "unknown section"),
    ('host = "127.0.0.1"', 'host = "127.0.0.1"\ntls_ca = "missing.crt"', "broker.tls_ca", "not found"),
    ('host = "127.0.0.1"', 'host = "127.0.0.1"\npassword = "x"', "broker.username", "required"),
    ("[storage]", '[source]\ntype = "serial"\n[storage]', "source.type", "stdin, file, mqtt"),
    ("[storage]", '[source]\ntype = "file"\n[storage]', "source.path", "required"),
    ("[storage]", '[source]\ntype = "mqtt"\n[storage]', "source.topic", "required"),
    ("[storage]", '[source]\ntype = "mqtt"\ntopic = "t"\nfield = "mac"\n[storage]', "source.field", "payload"),
    ("[storage]", '[source]\ntype = "stdin"\npath = "x"\n[storage]', "source.path", "does not apply"),
]


@pytest.mark.parametrize("old,new,key,words", BAD, ids=[b[2] + ":" + b[3] for b in BAD])
def test_bad_config_names_the_key(tmp_path, capsys, old, new, key, words):
    assert old in BASE
    path = write(tmp_path, BASE.replace(old, new, 1))
    with pytest.raises(ConfigError) as ei:
        agent_config.load(path)
    assert ei.value.key == key
    assert words in str(ei.value)
    # the CLI prints exactly one line naming the key and exits 2
    for cmd in ("check", "feed", "run"):
        assert main([cmd, "--config", path]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == ["pansketch-agent: config error: %s: %s" % (key, ei.value.msg)]


def test_toml_syntax_error_and_missing_file(tmp_path, capsys):
    path = write(tmp_path, BASE + "\nthis is = = not toml\n")
    assert main(["check", "--config", path]) == 2
    assert "not valid TOML" in capsys.readouterr().err
    assert main(["check", "--config", str(tmp_path / "nope.toml")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_config_error_exit_code_of_the_real_command(tmp_path):
    """The installed entry point's behaviour: a separate process, exit status 2, one stderr line."""
    path = write(tmp_path, BASE.replace('budget = "1/4"', 'budget = "-1/2"'))
    r = subprocess.run([sys.executable, "-m", "pansketch.agent.pi.daemon", "feed", "--config", path], input=b"a\n",
                       capture_output=True, cwd=REPO, timeout=60)
    assert r.returncode == 2
    assert r.stderr.decode().strip() == "pansketch-agent: config error: privacy.budget: must be positive"
    assert not os.path.exists(tmp_path / "st"), "a config error must not create state"


@pytest.mark.slow
def test_check_prints_noise_and_size(tmp_path, capsys):
    path = write(tmp_path, BASE)
    assert main(["check", "--offline", "--config", path]) == 0
    out = capsys.readouterr().out
    assert "discrete Laplace scale t = 24" in out  # Delta1/eps = d*clip/eps = 3*2*4
    assert "eps = 1/4" in out
    # 29 persists per 900 s epoch: auto picks shadow, whose internal noise is calibrated for 2 arrays
    assert "24 per cell output; 48 internal" in out and "persist_noise auto -> shadow" in out


def test_help_mentions_commands_and_exit_codes(capsys):
    with pytest.raises(SystemExit) as ei:
        main(["--help"])
    assert ei.value.code == 0
    out = capsys.readouterr().out
    for word in ("run", "feed", "check", "Exit codes"):
        assert word in out


def test_run_with_stdin_source_under_systemd_is_a_config_error(tmp_path):
    """systemd gives services /dev/null as stdin: 'run' would release at once and exit; refuse instead."""
    path = write(tmp_path, BASE + '[source]\ntype = "stdin"\n')
    r = subprocess.run([sys.executable, "-m", "pansketch.agent.pi.daemon", "run", "--config", path], stdin=subprocess.DEVNULL,
                       capture_output=True, cwd=REPO, timeout=60)
    assert r.returncode == 2
    assert r.stderr.decode().startswith("pansketch-agent: config error: source.type: ")


def test_systemd_unit_waits_for_ntp_sync():
    """time-sync.target only waits for NTP when systemd-time-wait-sync.service runs: pull it in, order after it."""
    import configparser

    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str  # type: ignore[assignment]
    unit.read(os.path.join(os.path.dirname(__file__), "..", "deploy", "systemd", "pansketch-agent.service"))
    wants = unit["Unit"]["Wants"].split()
    after = unit["Unit"]["After"].split()
    for name in ("time-sync.target", "systemd-time-wait-sync.service", "network-online.target"):
        assert name in wants and name in after, name


@pytest.mark.slow
def test_check_tree_mode_recommends_by_query_pattern(tmp_path, capsys):
    tree = (BASE.replace('mode = "keep"', 'mode = "tree"\nlevels = 12').replace("window_s = 3600\n", "")
            .replace("epoch_s = 900", "epoch_s = 60").replace("persist_s = 30", "persist_s = 86400"))
    path = write(tmp_path, tree)
    assert main(["check", "--offline", "--config", path, "--range-epochs", "1", "--range-epochs", "10080"]) == 0
    out = capsys.readouterr().out
    assert "tree, L = 12 levels" in out and "discrete Laplace scale t = 288" in out  # 12 * 3 * 2 / (1/4)
    assert "eps = 1/4" in out  # the guarantee over all 12 nodes holding an event
    rows = {line.split()[0]: line.split()[-1] for line in out.splitlines() if line.startswith("  1 ") or
            line.startswith("  10080 ")}
    assert rows == {"1": "window/keep", "10080": "tree"}
    assert 'mode = "tree"' in out and "recommendation" in out
    # frequent persists add a draw to every open node under refresh: the tree pays off only with
    # persist_noise = "shadow", and check says so
    path = write(tmp_path, tree.replace("persist_s = 86400", "persist_s = 30"))
    assert main(["check", "--offline", "--config", path, "--range-epochs", "1", "--range-epochs", "10080"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split()[-1] for line in out.splitlines() if line.startswith("  1 ") or
            line.startswith("  10080 ")}
    assert rows == {"1": "window/keep", "10080": "tree+shadow"}
    assert 'persist_noise = "shadow"' in out.split("recommendation")[1]
