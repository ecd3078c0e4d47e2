"""The board's config file (``/pansketch.json``): load, validate, report.

JSON because MicroPython reads it natively. Every error is a
:class:`ConfigError` naming the offending key as a dotted path
(``mqtt.port``, ``sketch.d``, ``source.pins[0].pin``) so the console
message tells the user exactly what to fix. Unknown keys are errors too
(a typo such as ``"pasword"`` must not be silently ignored). Sketch and
privacy settings are validated by the device core (``pansketch.agent.params.Params``),
whose ``ParamError.key`` is mapped back to its place in this file.

Layout (docs/FIRMWARE.md has the full reference)::

    {
      "device": "esp32-door-1",            # client id, topic level, release "dev"
      "salt": "our-fleet-salt-2026",       # fleet-wide hash salt (public, >= 8 chars)
      "sketch": {"kind": "cs", "d": 4, "w": 256, "mode": "window",
                 "window_s": 3600, "mechanism": "dgauss", "budget": "1/2",
                 "persist_s": 300},
      "wifi":   {"ssid": "...", "password": "..."},
      "ntp":    {"host": "pool.ntp.org"},
      "mqtt":   {"host": "broker.lan", "port": 8883, "user": "esp32-door-1",
                 "password": "...", "tls": {"ca": "/ca.der"}},
      "source": {"type": "gpio", "pins": [{"pin": 4, "label": "door"}]},
      "watchdog_s": 8,
      "state_dir": "/data"
    }
"""

import json

from pansketch.agent.params import ParamError, Params
from pansketch.firmware.sources import ConfigError  # the one config error (sources raise it too); re-exported

DEFAULT_PATH = "/pansketch.json"

SKETCH_KEYS = ("kind", "d", "w", "clip", "b", "map", "len", "mode", "window_s", "epoch_s", "levels", "mechanism", "budget",
               "persist_s", "persist_noise")
TOP_KEYS = (
    "device", "salt", "sketch", "wifi", "ntp", "mqtt", "source", "watchdog_s", "state_dir",
    "max_events_per_step", "idle_ms", "insecure_rng_seed", "outbox_max",
)
WIFI_KEYS = ("ssid", "password", "hostname", "connect_timeout_s", "retry_max_s")
NTP_KEYS = ("host", "timeout_s", "resync_s", "retry_max_s")
MQTT_KEYS = ("host", "port", "user", "password", "topic_prefix", "keepalive_s", "timeout_s", "retry_max_s", "tls",
             "ack_timeout_s")
TLS_KEYS = ("ca", "cert", "key", "verify", "server_hostname")


def _section(raw, name, keys, required=True):
    sec = raw.get(name)
    if sec is None:
        if required:
            raise ConfigError(name, "missing section")
        return {}
    if not isinstance(sec, dict):
        raise ConfigError(name, "must be an object")
    _unknown(sec, keys, name + ".")
    return sec


def _unknown(d, keys, prefix=""):
    for k in d:
        if k not in keys:
            raise ConfigError(prefix + k, "unknown key (allowed: %s)" % ", ".join(keys))


def _str(sec, key, path, default=None, required=False, empty=False):
    v = sec.get(key, default)
    if v is None:
        if required:
            raise ConfigError(path, "is required")
        return None
    if not isinstance(v, str) or (not empty and not v):
        raise ConfigError(path, "must be a non-empty string")
    return v


def _int(sec, key, path, default, lo, hi):
    v = sec.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ConfigError(path, "must be an integer, got %r" % (v,))
    if v < lo or v > hi:
        raise ConfigError(path, "must be between %d and %d, got %d" % (lo, hi, v))
    return v


def _bool(sec, key, path, default):
    v = sec.get(key, default)
    if v is not True and v is not False:
        raise ConfigError(path, "must be true or false")
    return v


class Config:
    """Validated settings; attributes mirror the file (see module docstring)."""

    def __init__(self, raw):
        if not isinstance(raw, dict):
            raise ConfigError("(file)", "the top level must be a JSON object")
        _unknown(raw, TOP_KEYS)
        sk = _section(raw, "sketch", SKETCH_KEYS, required=False)
        pdict = {}
        for k in sk:
            pdict[k] = sk[k]
        pdict["device"] = raw.get("device")
        pdict["salt"] = raw.get("salt")
        try:
            self.params = Params(pdict)
        except ParamError as exc:
            key = exc.key if exc.key in ("device", "salt") else "sketch." + exc.key
            raise ConfigError(key, str(exc)[len(exc.key) + 2:])
        self.device = self.params.device

        w = _section(raw, "wifi", WIFI_KEYS)
        self.wifi_ssid = _str(w, "ssid", "wifi.ssid", required=True)
        self.wifi_password = _str(w, "password", "wifi.password", "", empty=True)
        self.wifi_hostname = _str(w, "hostname", "wifi.hostname")
        self.wifi_timeout_s = _int(w, "connect_timeout_s", "wifi.connect_timeout_s", 20, 1, 600)
        self.wifi_retry_max_s = _int(w, "retry_max_s", "wifi.retry_max_s", 300, 1, 86400)

        n = _section(raw, "ntp", NTP_KEYS, required=False)
        self.ntp_host = _str(n, "host", "ntp.host", "pool.ntp.org")
        self.ntp_timeout_s = _int(n, "timeout_s", "ntp.timeout_s", 2, 1, 30)
        self.ntp_resync_s = _int(n, "resync_s", "ntp.resync_s", 6 * 3600, 60, 30 * 86400)
        self.ntp_retry_max_s = _int(n, "retry_max_s", "ntp.retry_max_s", 300, 1, 86400)

        m = _section(raw, "mqtt", MQTT_KEYS)
        self.mqtt_host = _str(m, "host", "mqtt.host", required=True)
        tls = m.get("tls")
        if tls is not None and tls is not False:
            if tls is True:
                tls = {}
            if not isinstance(tls, dict):
                raise ConfigError("mqtt.tls", "must be an object, true, false or null")
            _unknown(tls, TLS_KEYS, "mqtt.tls.")
            self.tls_ca = _str(tls, "ca", "mqtt.tls.ca")
            self.tls_cert = _str(tls, "cert", "mqtt.tls.cert")
            self.tls_key = _str(tls, "key", "mqtt.tls.key")
            if (self.tls_cert is None) != (self.tls_key is None):
                raise ConfigError("mqtt.tls.cert" if self.tls_cert is None else "mqtt.tls.key",
                                  "client certificate and key must be given together")
            self.tls_verify = _bool(tls, "verify", "mqtt.tls.verify", True)
            if self.tls_verify and self.tls_ca is None:
                raise ConfigError("mqtt.tls.ca", "is required to verify the broker (or set \"verify\": false, "
                                  "which lets anyone on the network impersonate the broker)")
            self.tls_server_hostname = _str(tls, "server_hostname", "mqtt.tls.server_hostname", self.mqtt_host)
            self.tls = True
        else:
            self.tls = False
            self.tls_ca = self.tls_cert = self.tls_key = self.tls_server_hostname = None
            self.tls_verify = False
        self.mqtt_port = _int(m, "port", "mqtt.port", 8883 if self.tls else 1883, 1, 65535)
        self.mqtt_user = _str(m, "user", "mqtt.user")
        self.mqtt_password = _str(m, "password", "mqtt.password", empty=True)
        if self.mqtt_password is not None and self.mqtt_user is None:
            raise ConfigError("mqtt.user", "is required when mqtt.password is set")
        self.topic_prefix = _str(m, "topic_prefix", "mqtt.topic_prefix", "pansketch")
        for ch in "+#":
            if ch in self.topic_prefix:
                raise ConfigError("mqtt.topic_prefix", "must not contain MQTT wildcards")
        if self.topic_prefix.endswith("/"):
            raise ConfigError("mqtt.topic_prefix", "must not end with '/'")
        self.keepalive_s = _int(m, "keepalive_s", "mqtt.keepalive_s", 120, 0, 65535)
        self.mqtt_timeout_s = _int(m, "timeout_s", "mqtt.timeout_s", 3, 1, 60)
        self.mqtt_retry_max_s = _int(m, "retry_max_s", "mqtt.retry_max_s", 300, 1, 86400)
        self.ack_timeout_s = _int(m, "ack_timeout_s", "mqtt.ack_timeout_s", 60, 1, 86400)

        self.watchdog_s = _int(raw, "watchdog_s", "watchdog_s", 8, 0, 3600)
        if self.watchdog_s and self.watchdog_s <= self.mqtt_timeout_s:
            raise ConfigError("watchdog_s", "must be longer than mqtt.timeout_s (%d s) or 0 to disable"
                              % self.mqtt_timeout_s)
        sd = _str(raw, "state_dir", "state_dir", "/data")
        if not sd.startswith("/") or (len(sd) > 1 and sd.endswith("/")):
            raise ConfigError("state_dir", "must be an absolute path without a trailing '/'")
        self.state_dir = sd
        self.max_events = _int(raw, "max_events_per_step", "max_events_per_step", 64, 1, 100000)
        self.idle_ms = _int(raw, "idle_ms", "idle_ms", 20, 0, 10000)
        self.outbox_max = _int(raw, "outbox_max", "outbox_max", 0, 0, 1000000)
        seed = raw.get("insecure_rng_seed")
        if seed is not None and (not isinstance(seed, str) or not seed):
            raise ConfigError("insecure_rng_seed", "must be a non-empty string (tests only) or absent")
        self.insecure_rng_seed = seed

        src = raw.get("source")
        if not isinstance(src, dict):
            raise ConfigError("source", "missing section (an object with a \"type\")")
        from pansketch.firmware import sources

        self.source_type, self.source = sources.check(src)

    def status_info(self):
        """Data-independent facts for the status message (same keys as the Pi agent)."""
        p = self.params
        return (
            ("budget", "%d/%d" % (p.budget[0], p.budget[1])),
            ("d", p.d),
            ("ep_s", p.epoch_s),
            ("kind", p.kind),
            ("mech", p.mechanism),
            ("mode", p.mode),
            ("w", p.w),
            ("win_s", p.window_s),
        )


def loads(text):
    try:
        raw = json.loads(text)
    except ValueError as exc:
        raise ConfigError("(file)", "not valid JSON (%s)" % (exc,))
    return Config(raw)


def load(path=DEFAULT_PATH):
    try:
        f = open(path)
    except OSError:
        raise ConfigError("(file)", "%s not found; copy deploy/board/pansketch.example.json there "
                          "(deploy/flash.sh --config does it)" % path)
    try:
        text = f.read()
    finally:
        f.close()
    return loads(text)
