"""Agent configuration: one TOML file -> validated settings (docs/AGENT.md).

CPython only (tomllib / tomli, dataclasses, typing): this module is part of
the Raspberry Pi daemon, **not** of the MicroPython device core. Boards read
their parameters from JSON in firmware/ and validate them with the same
:class:`pansketch.agent.params.Params`.

Every error is a :class:`ConfigError` whose ``key`` is the dotted TOML key
(``privacy.budget``), so the daemon can print one line naming it::

    pansketch-agent: config error: privacy.budget: must be positive
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from pansketch.agent.pi import tomlconf
from pansketch.agent.pi.tomlconf import ConfigError
from pansketch.agent.pi.tomlconf import get as _get
from pansketch.agent.pi.tomlconf import path as _path
from pansketch.agent.pi.tomlconf import seconds as _seconds

from pansketch.agent.params import ParamError, Params

# TOML section.key -> pansketch.agent.params.Params key
PARAM_KEYS: dict[str, str] = {
    "device.id": "device",
    "device.salt": "salt",
    "sketch.kind": "kind",
    "sketch.d": "d",
    "sketch.w": "w",
    "sketch.clip": "clip",
    "sketch.b": "b",
    "sketch.map": "map",
    "sketch.len": "len",
    "privacy.mode": "mode",
    "privacy.window_s": "window_s",
    "privacy.epoch_s": "epoch_s",
    "privacy.levels": "levels",
    "privacy.mechanism": "mechanism",
    "privacy.budget": "budget",
    "storage.persist_s": "persist_s",
    "storage.persist_noise": "persist_noise",
}
PARAM_TO_TOML: dict[str, str] = {v: k for k, v in PARAM_KEYS.items()}

BROKER_KEYS = (
    "host", "port", "tls", "tls_ca", "tls_cert", "tls_key", "username", "password",
    "password_file", "keepalive", "topic_prefix", "reconnect_min_s", "reconnect_max_s", "ack_timeout_s",
    "mqtt_version",
)
SOURCE_KEYS = (
    "type", "path", "follow", "from_start", "host", "port", "topic", "field", "weight_field",
    "username", "password", "password_file", "tls_ca", "tls_cert", "tls_key", "qos",
)
SECTIONS: dict[str, tuple[str, ...]] = {
    "broker": BROKER_KEYS,
    "device": ("id", "salt"),
    "sketch": ("kind", "d", "w", "clip", "b", "map", "len"),
    "privacy": ("mode", "mechanism", "budget", "window_s", "epoch_s", "levels"),
    "storage": ("dir", "persist_s", "persist_noise", "outbox_max"),
    "source": SOURCE_KEYS,
}
SOURCE_TYPES = ("stdin", "file", "mqtt")


@dataclass
class TLSConfig:
    ca: Optional[str] = None
    cert: Optional[str] = None
    key: Optional[str] = None


@dataclass
class BrokerConfig:
    """The upstream broker releases go to."""

    host: str = "localhost"
    port: int = 1883
    tls: Optional[TLSConfig] = None
    username: Optional[str] = None
    password: Optional[str] = None
    keepalive: int = 60
    topic_prefix: str = "pansketch"
    reconnect_min_s: float = 1.0
    reconnect_max_s: float = 60.0
    ack_timeout_s: float = 60.0  # re-send a release the host has not acknowledged after this long
    mqtt_version: str = "5"  # or "3.1.1" (brokers without MQTT 5: RabbitMQ 3.x, deploy/rabbitmq)


@dataclass
class SourceConfig:
    """Where events come from."""

    type: str = "stdin"
    path: Optional[str] = None  # file
    follow: bool = True  # file: keep reading appended lines (tail -F)
    from_start: bool = False  # file + follow: read existing lines first
    host: str = "localhost"  # mqtt (the *local* broker of the raw readings)
    port: int = 1883
    topic: Optional[str] = None
    field: str = "payload"  # dotted path into {"topic": ..., "payload": ...}
    weight_field: Optional[str] = None
    username: Optional[str] = None
    password: Optional[str] = None
    tls: Optional[TLSConfig] = None
    qos: int = 0


@dataclass
class AgentConfig:
    params: Params
    broker: BrokerConfig
    source: SourceConfig
    state_dir: str
    path: Optional[str] = None
    outbox_max: int = 0  # 0: bounded by the disk only
    raw: dict[str, Any] = field(default_factory=dict)

    @property
    def device(self) -> str:
        return self.params.device

    def topic(self, leaf: str) -> str:
        return "%s/%s/%s" % (self.broker.topic_prefix, self.params.device, leaf)


# -- helpers ---------------------------------------------------------------


def _port(sec: dict[str, Any], secname: str, default: int) -> int:
    p = _get(sec, secname, "port", int, default)
    if not 1 <= p <= 65535:
        raise ConfigError(secname + ".port", "must be between 1 and 65535, got %d" % p)
    return p


def _tls(sec: dict[str, Any], secname: str, base: str) -> Optional[TLSConfig]:
    ca, cert, key, on = tomlconf.tls_files(sec, secname, base)
    if on is False:
        return None
    if on or ca or cert:
        return TLSConfig(ca, cert, key)
    return None


def field_path(spec: str, key: str) -> list[str]:
    """Split and check a JSON field path such as ``payload.mac`` or ``payload.devs.0``."""
    parts = spec.split(".")
    if parts[0] not in ("payload", "topic") or any(not p for p in parts):
        raise ConfigError(key, "must be a dotted path starting with 'payload' (the message's JSON) "
                               "or 'topic', e.g. 'payload.mac', got %r" % (spec,))
    if parts[0] == "topic" and len(parts) > 2:
        raise ConfigError(key, "'topic' may only be followed by a level index, e.g. 'topic.1'")
    return parts


# -- loading ---------------------------------------------------------------
def from_dict(raw: dict[str, Any], base_dir: str = ".", path: Optional[str] = None) -> AgentConfig:
    sec = tomlconf.sections(raw, SECTIONS)

    # device parameters: mapped onto pansketch.agent.params.Params, which names the bad key
    pcfg: dict[str, Any] = {}
    for tkey, pkey in PARAM_KEYS.items():
        sname, k = tkey.split(".")
        if k in sec(sname):
            pcfg[pkey] = sec(sname)[k]
    if "device" not in pcfg:
        raise ConfigError("device.id", "is required (a name unique in the fleet, e.g. 'pi-kitchen')")
    if "salt" not in pcfg:
        raise ConfigError("device.salt", "is required (the fleet's shared hash salt, same on every device)")
    if isinstance(pcfg.get("budget"), float):
        raise ConfigError("privacy.budget", "write it as a string such as \"1/2\" or \"0.5\" "
                                            "(TOML floats are inexact; the noise path is exact)")
    try:
        params = Params(pcfg)
    except ParamError as exc:
        key = PARAM_TO_TOML.get(exc.key, exc.key)
        msg = str(exc)
        prefix = exc.key + ": "
        raise ConfigError(key, msg[len(prefix):] if msg.startswith(prefix) else msg)

    # storage
    st = sec("storage")
    sdir = _get(st, "storage", "dir", str, None)
    if not sdir:
        raise ConfigError("storage.dir", "is required (a directory for the outbox and the noisy state, "
                                         "e.g. '/var/lib/pansketch')")
    state_dir = _path(base_dir, sdir) or sdir
    outbox_max = _get(st, "storage", "outbox_max", int, 0)
    if outbox_max < 0:
        raise ConfigError("storage.outbox_max", "must be 0 (no limit but the disk) or a positive number of releases")

    # broker
    b = sec("broker")
    tls = _tls(b, "broker", base_dir)
    broker = BrokerConfig(
        host=_get(b, "broker", "host", str, "localhost"),
        port=_port(b, "broker", 8883 if tls else 1883),
        tls=tls,
        username=_get(b, "broker", "username", str, None),
        password=tomlconf.password(b, "broker", base_dir),
        keepalive=_get(b, "broker", "keepalive", int, 60),
        topic_prefix=_get(b, "broker", "topic_prefix", str, "pansketch"),
        reconnect_min_s=_seconds(b, "broker", "reconnect_min_s", 1.0),
        reconnect_max_s=_seconds(b, "broker", "reconnect_max_s", 60.0),
        ack_timeout_s=_seconds(b, "broker", "ack_timeout_s", 60.0),
        mqtt_version=_get(b, "broker", "mqtt_version", str, "5"),
    )
    if broker.mqtt_version not in ("5", "3.1.1"):
        raise ConfigError("broker.mqtt_version", "must be \"5\" or \"3.1.1\", got %r" % broker.mqtt_version)
    if not 5 <= broker.keepalive <= 65535:
        raise ConfigError("broker.keepalive", "must be between 5 and 65535 seconds")
    if not broker.topic_prefix or any(c in broker.topic_prefix for c in "+#") or broker.topic_prefix.endswith("/"):
        raise ConfigError("broker.topic_prefix", "must be a plain topic prefix without wildcards")
    tomlconf.check_client("broker", broker.username, broker.password, broker.reconnect_min_s,
                          broker.reconnect_max_s)

    # source
    s = sec("source")
    stype = _get(s, "source", "type", str, "stdin")
    if stype not in SOURCE_TYPES:
        raise ConfigError("source.type", "must be one of %s, got %r" % (", ".join(SOURCE_TYPES), stype))
    allowed = {"stdin": ("type",),
               "file": ("type", "path", "follow", "from_start"),
               "mqtt": ("type", "host", "port", "topic", "field", "weight_field", "username", "password",
                        "password_file", "tls_ca", "tls_cert", "tls_key", "qos")}[stype]
    for k in s:
        if k not in allowed:
            raise ConfigError("source." + k, "does not apply to source.type = %r" % stype)
    source = SourceConfig(type=stype)
    if stype == "file":
        p = _get(s, "source", "path", str, None)
        if not p:
            raise ConfigError("source.path", "is required for source.type = 'file'")
        source.path = _path(base_dir, p)
        source.follow = _get(s, "source", "follow", bool, True)
        source.from_start = _get(s, "source", "from_start", bool, not source.follow)
    elif stype == "mqtt":
        source.host = _get(s, "source", "host", str, "localhost")
        source.tls = _tls(s, "source", base_dir)
        source.port = _port(s, "source", 8883 if source.tls else 1883)
        source.topic = _get(s, "source", "topic", str, None)
        if not source.topic:
            raise ConfigError("source.topic", "is required for source.type = 'mqtt' (e.g. 'tele/+/SENSOR')")
        source.field = _get(s, "source", "field", str, "payload")
        field_path(source.field, "source.field")
        source.weight_field = _get(s, "source", "weight_field", str, None)
        if source.weight_field is not None:
            field_path(source.weight_field, "source.weight_field")
        source.username = _get(s, "source", "username", str, None)
        source.password = tomlconf.password(s, "source", base_dir)
        source.qos = _get(s, "source", "qos", int, 0)
        if source.qos not in (0, 1):
            raise ConfigError("source.qos", "must be 0 or 1")
    return AgentConfig(params=params, broker=broker, source=source, state_dir=state_dir, path=path,
                       outbox_max=outbox_max, raw=raw)


# loads(text, base_dir=".", path=None) and load(path): parse and validate (raise ConfigError)
loads, load = tomlconf.loaders(from_dict)
