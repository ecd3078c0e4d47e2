"""The board config file: every mistake names its key; on the board a bad
config (or anything else that makes running unsafe) gives a clear console
message and a safe idle state -- no watchdog, no crash loop."""

from __future__ import annotations

import json
import re
import sys

import pytest

from tests.support import mpvm
from tests.support import firmware as S

sys.path.insert(0, str(S.REPO))
from pansketch.firmware.config import Config, ConfigError, loads  # noqa: E402


def _with(path: str, value):
    c = S.config()
    node = c
    keys = path.split(".")
    for k in keys[:-1]:
        node = node.setdefault(k, {})
    if value is KeyError:
        del node[keys[-1]]
    else:
        node[keys[-1]] = value
    return c


BAD = [
    ("wifi", KeyError, "wifi"),
    ("wifi.ssid", KeyError, "wifi.ssid"),
    ("wifi.pasword", "x", "wifi.pasword"),
    ("wifii", {}, "wifii"),
    ("device", "bad device!", "device"),
    ("salt", "short", "salt"),
    ("sketch.d", 0, "sketch.d"),
    ("sketch.w", "1024", "sketch.w"),
    ("sketch.mode", "binary", "sketch.mode"),
    ("sketch.budget", 0.5, "sketch.budget"),
    ("sketch.epoch_s", 300, "sketch.epoch_s"),
    ("mqtt.host", KeyError, "mqtt.host"),
    ("mqtt.port", 0, "mqtt.port"),
    ("mqtt.user", KeyError, "mqtt.user"),
    ("mqtt.topic_prefix", "a/#", "mqtt.topic_prefix"),
    ("mqtt.tls", {"verify": True}, "mqtt.tls.ca"),
    ("mqtt.tls", {"ca": "/ca.der", "cert": "/c.der"}, "mqtt.tls.key"),
    ("mqtt.tls", {"ca": "/ca.der", "sni": "x"}, "mqtt.tls.sni"),
    ("watchdog_s", 2, "watchdog_s"),
    ("state_dir", "data", "state_dir"),
    ("insecure_rng_seed", 7, "insecure_rng_seed"),
    ("source", KeyError, "source"),
    ("source", {"type": "nosuchsource"}, "source.type"),
    ("source", {"type": "gpio", "pins": []}, "source.pins"),
    ("source", {"type": "gpio", "pins": [{"pin": 4}]}, "source.pins[0].label"),
    ("source", {"type": "gpio", "pins": [{"pin": 4, "label": "a", "trigger": "up"}]}, "source.pins[0].trigger"),
    ("source", {"type": "uart", "baudrate": 12}, "source.baudrate"),
    ("source", {"type": "uart", "bogus": 1}, "source.bogus"),
    ("source", {"type": "ble", "window_us": 60000}, "source.window_us"),
]


@pytest.mark.parametrize("path,value,key", BAD, ids=[b[2] + ("-" + str(i)) for i, b in enumerate(BAD)])
def test_bad_config_names_the_key(path, value, key):
    with pytest.raises(ConfigError) as ei:
        Config(_with(path, value))
    assert ei.value.key == key
    assert str(ei.value).startswith(key + ": ")


def test_good_configs_and_examples():
    c = Config(S.config(mqtt={"tls": {"ca": "/ca.der"}}))
    assert (c.mqtt_port, c.tls, c.tls_verify, c.tls_server_hostname) == (8883, True, True, "broker.lan")
    assert Config(S.config()).mqtt_port == 1883
    for ex in sorted((S.REPO / "deploy" / "board").glob("*.json")):
        Config(json.loads(ex.read_text()))
    with pytest.raises(ConfigError) as ei:
        loads("{not json")
    assert ei.value.key == "(file)"


def test_every_key_is_documented():
    doc = (S.REPO / "docs" / "FIRMWARE.md").read_text()
    from pansketch.firmware import config as fc
    from pansketch.firmware.sources import ble, gpio, pulse, uart

    keys = set(fc.TOP_KEYS + fc.SKETCH_KEYS + fc.WIFI_KEYS + fc.NTP_KEYS + fc.MQTT_KEYS + fc.TLS_KEYS
               + gpio.PIN_KEYS + uart.KEYS + ble.KEYS + pulse.KEYS)
    missing = sorted(k for k in keys if "`%s`" % k not in doc)
    assert not missing, "undocumented config keys: %s" % missing


@pytest.mark.skipif(not mpvm.available(), reason="MicroPython VM not installed (run .ci/run)")
def test_board_idles_safely_and_says_why(tmp_path):
    flash = tmp_path / "f"
    good = S.config()
    cases = {
        "badjson": "{\"device\": ",
        "badkey": json.dumps(_with("sketch.d", 0)),  # raised by pansketch.agent.params on MicroPython
        "nowifi": json.dumps(_with("wifi", KeyError)),
        "noseed": json.dumps(_with("insecure_rng_seed", KeyError)),  # the VM has no os.urandom
        "huge": json.dumps(S.config(sketch={"d": 32, "w": 1 << 22})),
    }
    S.write_config(flash, good)
    for name, text in cases.items():
        (flash / (name + ".json")).write_text(text)
    code = ["fakehw.install()\nfrom pansketch.firmware import app\nres = {}\n"]
    for name in list(cases) + ["missing"]:
        code.append("a = app.boot('/flash/%s.json')\nprint('@%s', type(a).__name__, a.step())" % (name, name))
    code.append("print('@wdt', fakehw.wdt['armed'])\na = app.main('/flash/badkey.json', max_steps=40)\n"
                "print('@main', type(a).__name__, fakehw.ms)")
    # state written by other parameters: refuse to start, keep the outbox, say what to do
    code.append("import fakefs\nfakefs.install('/flash')\na = app.boot('/flash/pansketch.json')\n"
                "a.rec.persist()\nprint('@good', type(a).__name__)")
    other = S.config(sketch={"budget": "1"})
    (flash / "other.json").write_text(json.dumps(other))
    code.append("a = app.boot('/flash/other.json')\nprint('@other', type(a).__name__)")
    r = S.run(code, flash).check()
    v = r.values()
    for name in list(cases) + ["missing"]:
        assert v[name] == "Idle 1000", name
    assert v["wdt"] == "False"  # an idle board never arms the watchdog: no reset loop
    assert v["main"].startswith("Idle ")
    assert v["good"] == "App" and v["other"] == "Idle"
    out = r.stdout
    assert "NOT RUNNING: config error in /flash/badjson.json: (file): not valid JSON" in out
    assert "NOT RUNNING: config error in /flash/badkey.json: sketch.d: must be between 1 and 32, got 0" in out
    assert "NOT RUNNING: config error in /flash/nowifi.json: wifi: missing section" in out
    assert "no cryptographic random source on this board" in out
    assert re.search(r"out of memory allocating the sketch: d\*w = 134217728 cells", out)
    assert "/flash/missing.json not found; copy deploy/board/pansketch.example.json" in out
    assert "was written with different parameters" in out and "Pending releases are in /flash/data/outbox" in out
    # the idle loop repeats its reason every 30 s: once in the boot loop above, twice in 40 s of main()
    assert out.count("idle: config error in /flash/badkey.json") == 3
