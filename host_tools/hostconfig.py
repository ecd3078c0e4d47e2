"""Host configuration: one TOML file for ``aggregate``, ``status`` and ``query``.

Reference: docs/HOST.md. Sections and keys (defaults)::

    [broker]      host ("localhost"), port (1883; 8883 with TLS), tls (false),
                  tls_ca, tls_cert, tls_key, username, password, password_file,
                  client_id (see below), keepalive (60),
                  reconnect_min_s (1), reconnect_max_s (60),
                  mqtt_version ("5"; "3.1.1" for a broker that speaks
                  only that, such as amqtt: no shared_group then),
                  kind ("mosquitto"; "rabbitmq": the aggregator consumes a
                  quorum queue over AMQP, pansketch.host_tools.ingest.amqp), and for
                  kind = "rabbitmq": amqp_nodes (["<host>:5672"]; 5671 with
                  TLS), queue ("pansketch.releases"), vhost ("/")
    [aggregator]  db ("pansketch.db", relative to the config file; or a
                  "postgresql://user@host:port/dbname" URL: pansketch.host_tools.store.pg),
                  topic ("pansketch/+/release"), shared_group (""),
                  max_bytes (1048576), qos (1), session_expiry_s (86400;
                  0 with a shared_group: see AggregatorConfig);
                  hostile input (docs/HOST.md "Hostile input"):
                  validate_cpu_s (1), reject_keep_bytes (256),
                  rejections_max_rows (10000), rejections_max_bytes
                  (16777216), rejections_retention_s (2592000),
                  reject_log_interval_s (60), max_clock_skew_s (600),
                  max_past_s (157788000: five years; 0 = no bound),
                  max_seq_jump (100000), quarantine_max_rows (1000),
                  quarantine_max_bytes (67108864);
                  group_wait_ms (200: how long the writer gathers a group
                  commit), wal_limit_mb (64: SQLite WAL size that makes the
                  writer run a RESTART checkpoint), drop_cache_behind_mb
                  (64: SQLite: cached pages of the database file further
                  back than this from its end are dropped once on disk;
                  0 never), retain_raw_s (0: keep
                  raw release payloads forever; else prune rolled-up ones
                  that much older than their receipt: docs/HOST.md)
    [fleet]       salt or salt_id (one is required; queries need salt),
                  kind, d, w, mechanism (optional: enforced when given);
                  max_events_per_window (100000): the contribution limit
                  of one device per window (docs/PRIVACY.md "Bounded
                  influence"), and max_events_per_window_<kind> (kind cms,
                  cs, dcs, strhh or dbits) where a kind's differs;
                  max_clip (1): the largest event weight devices use
    [query]       confidence (0.95), delta ("1e-6": for the (eps, delta)
                  report of zCDP guarantees)
    [status]      late_grace_s (none: max(epoch length, 300 s)): a release
                  received later than this after its epochs is "late"
    [store]       compress (unset: on PostgreSQL every release of at
                  least 1 KiB of counters, on SQLite those of at least
                  24 KiB; true: every one of at least 1 KiB; false: none):
                  write release payloads zstd-compressed
                  (pansketch.host_tools.store.payloadcodec; docs/HOST.md
                  "Stored encoding" has the CPU and bytes of each choice);
                  a store reads both encodings whatever it writes

Every error is a :class:`ConfigError` whose ``key`` is the dotted TOML key;
the CLI prints ``pansketch: config error: <key>: <message>`` and exits 2.
"""

from __future__ import annotations

import os
import re
import socket
import sys
from dataclasses import dataclass, field
from typing import Any, Optional

from pansketch.agent.pi import tomlconf
from pansketch.agent.pi.tomlconf import ConfigError
from pansketch.agent.pi.tomlconf import get as _get
from pansketch.agent.pi.tomlconf import int_range as _int_range
from pansketch.agent.pi.tomlconf import path as _path
from pansketch.agent.pi.tomlconf import seconds as _seconds

from pansketch.agent import hashing
from pansketch.agent.calibrate import MECHANISMS, parse_ratio
from pansketch.agent.sketch import KINDS

# [fleet] max_events_per_window: the contribution limit of one device per window (pansketch.host_tools.store.bounds)
DEFAULT_MAX_EVENTS = 100_000  # the small devices the examples describe; raise it in one line for busier ones
MAX_MAX_EVENTS = 1 << 40
LIMIT_KINDS = ("cms", "cs", "dcs", "strhh", "dbits")

# [broker] mqtt_version as written -> the protocol level on the wire (paho's MQTTv5 = 5, MQTTv311 = 4)
MQTT_VERSIONS = {"5": 5, "5.0": 5, "3.1.1": 4}

SECTIONS: dict[str, tuple[str, ...]] = {
    "broker": ("host", "port", "tls", "tls_ca", "tls_cert", "tls_key", "username", "password",
               "password_file", "client_id", "keepalive", "reconnect_min_s", "reconnect_max_s",
               "mqtt_version", "kind", "amqp_nodes", "queue", "vhost"),
    "aggregator": ("db", "topic", "shared_group", "max_bytes", "qos", "session_expiry_s", "validate_cpu_s",
                   "reject_keep_bytes", "rejections_max_rows", "rejections_max_bytes", "rejections_retention_s",
                   "reject_log_interval_s", "max_clock_skew_s", "max_past_s", "max_seq_jump", "quarantine_max_rows",
                   "quarantine_max_bytes", "group_wait_ms", "wal_limit_mb", "drop_cache_behind_mb",
                   "retain_raw_s"),
    "fleet": ("salt", "salt_id", "kind", "d", "w", "mechanism", "max_events_per_window", "max_clip")
    + tuple("max_events_per_window_" + k for k in LIMIT_KINDS),
    "query": ("confidence", "delta"),
    "status": ("late_grace_s",),
    "store": ("compress",),
}

DEFAULT_TOPIC = "pansketch/+/release"
DEFAULT_SESSION_EXPIRY_S = 86400  # a lone aggregator: releases wait in its session over a restart
MIN_RETAIN_RAW_S = 60  # retention: the shortest raw-payload lifetime accepted
SHARED_SESSION_EXPIRY_S = 0  # a shared-group member: its session ends with its connection (docs/HOST.md)


# releases for windows that ended longer ago than this are quarantined: no honest device holds a
# release for five years, and a board or Pi whose clock reads 1970 or 2000 must not add old windows
MAX_PAST_S = 5 * 365.25 * 86400

@dataclass
class BrokerConfig:
    host: str = "localhost"
    port: int = 1883
    tls: bool = False
    tls_ca: Optional[str] = None
    tls_cert: Optional[str] = None
    tls_key: Optional[str] = None
    username: Optional[str] = None
    password: Optional[str] = None
    client_id: str = ""
    keepalive: int = 60
    reconnect_min_s: float = 1.0
    reconnect_max_s: float = 60.0
    # the MQTT protocol level the aggregator speaks: 5 (MQTT v5), or 4 (MQTT 3.1.1) for a broker that knows
    # nothing newer (the demo's pure-Python amqtt). Same aggregator either way; 3.1.1 lacks only what v5
    # adds around it (Receive Maximum, session expiry as an interval, shared subscriptions).
    mqtt_version: int = 5
    kind: str = "mosquitto"  # or "rabbitmq" (pansketch.host_tools.ingest.amqp)
    amqp_nodes: tuple[tuple[str, int], ...] = ()
    queue: str = "pansketch.releases"
    vhost: str = "/"


@dataclass
class AggregatorConfig:
    db: str = "pansketch.db"
    topic: str = DEFAULT_TOPIC
    shared_group: str = ""
    max_bytes: int = 1 << 20
    qos: int = 1
    # -1: the default for the mode, resolved below: 86400 for a lone aggregator (releases wait for it
    # across a restart), 0 for a shared-group member (clean start: a member that dies leaves the group
    # at once; mosquitto 2.0 would otherwise keep handing its offline session a share of the releases)
    session_expiry_s: int = -1
    validate_cpu_s: float = 1.0  # per-message CPU budget of validation: over it, refused with code 'timeout'
    reject_keep_bytes: int = 256  # prefix of a refused payload kept (with its SHA-256, size and reason)
    rejections_max_rows: int = 10000
    rejections_max_bytes: int = 16 << 20
    rejections_retention_s: float = 30 * 86400.0
    reject_log_interval_s: float = 60.0  # at most 10 rejection warnings per interval, then one summary
    max_clock_skew_s: float = 600.0  # a release whose epochs start later than now + this is quarantined
    # ... and one whose epochs ended longer ago than this (a clock at 1970 or 2000; 0: no bound)
    max_past_s: float = MAX_PAST_S
    max_seq_jump: int = 100000  # ... and one whose seq is this far above the device's highest stored seq
    quarantine_max_rows: int = 1000
    quarantine_max_bytes: int = 64 << 20
    group_wait_ms: int = 200  # the writer waits up to this for more messages before a group commit
    wal_limit_mb: int = 64  # SQLite: a WAL larger than this is checkpointed (RESTART) by the writer
    drop_cache_behind_mb: int = 64  # SQLite: page cache of the file kept only this far back from its end; 0: all
    retain_raw_s: int = 0  # 0: keep raw payloads; else prune rolled-up releases received this long ago

    def __post_init__(self) -> None:
        if self.session_expiry_s < 0:
            self.session_expiry_s = SHARED_SESSION_EXPIRY_S if self.shared_group else DEFAULT_SESSION_EXPIRY_S

    @property
    def subscription(self) -> str:
        """The topic filter to subscribe (MQTT v5 shared subscription when a group is set)."""
        if self.shared_group:
            return "$share/%s/%s" % (self.shared_group, self.topic)
        return self.topic


@dataclass
class FleetConfig:
    salt: Optional[str] = None
    salt_id: Optional[str] = None
    kind: Optional[str] = None
    d: Optional[int] = None
    w: Optional[int] = None
    mechanism: Optional[str] = None
    # the contribution limit of one device per window (events; for dbits distinct items): a release no
    # device with this many events could have produced is quarantined (pansketch.host_tools.store.bounds)
    max_events_per_window: int = DEFAULT_MAX_EVENTS
    max_events_by_kind: dict[str, int] = field(default_factory=dict)  # where a kind's limit differs
    # the largest event weight the fleet's devices use: a release claiming a larger clip (a thief's way
    # to multiply the limit clip * max_events) is held to this one
    max_clip: int = 1

    def max_events(self, kind: str) -> int:
        """The limit for releases of ``kind``."""
        return self.max_events_by_kind.get(kind, self.max_events_per_window)


@dataclass
class QueryConfig:
    confidence: float = 0.95
    delta: float = 1e-6


@dataclass
class StatusConfig:
    late_grace_s: Optional[float] = None


@dataclass
class StoreConfig:
    compress: Optional[bool] = None  # None: the backend's default (SQLStore.compress_default_bytes)


@dataclass
class HostConfig:
    broker: BrokerConfig = field(default_factory=BrokerConfig)
    aggregator: AggregatorConfig = field(default_factory=AggregatorConfig)
    fleet: FleetConfig = field(default_factory=FleetConfig)
    query: QueryConfig = field(default_factory=QueryConfig)
    status: StatusConfig = field(default_factory=StatusConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    path: Optional[str] = None

    def require_salt(self) -> str:
        """The fleet salt (queries hash items with it)."""
        if not self.fleet.salt:
            raise ConfigError("fleet.salt", "is required for queries (salt_id alone cannot hash items)")
        return self.fleet.salt


# -- helpers ---------------------------------------------------------------
def _fraction_float(sec: dict[str, Any], secname: str, key: str, default: float) -> float:
    """A probability in (0, 1) given as a number or a string ('1e-6', '1/1000000')."""
    if key not in sec:
        return default
    v = sec[key]
    k = "%s.%s" % (secname, key)
    if isinstance(v, bool):
        raise ConfigError(k, "must be a number in (0, 1), got a boolean")
    if isinstance(v, str):
        try:
            n, d = parse_ratio(v)
        except (ValueError, ZeroDivisionError) as exc:
            raise ConfigError(k, "must be a number in (0, 1): %s" % exc)
        v = n / d
    if not isinstance(v, (int, float)) or not 0 < v < 1:
        raise ConfigError(k, "must be a number strictly between 0 and 1, got %r" % (v,))
    return float(v)


def _topic_filter(topic: str, key: str) -> str:
    if not topic or len(topic.encode()) > 65535 or "\x00" in topic:
        raise ConfigError(key, "must be a non-empty MQTT topic filter")
    levels = topic.split("/")
    for i, lev in enumerate(levels):
        if "#" in lev and (lev != "#" or i != len(levels) - 1):
            raise ConfigError(key, "'#' may only be a whole last level")
        if "+" in lev and lev != "+":
            raise ConfigError(key, "'+' must be a whole level")
    if topic.startswith("$share/"):
        raise ConfigError(key, "give the plain filter here and the group in aggregator.shared_group")
    if levels[-1] != "release":
        raise ConfigError(key, "must end with '/release' (devices publish to <prefix>/<device>/release)")
    if len(levels) < 2:
        raise ConfigError(key, "needs a device level before 'release' (e.g. 'pansketch/+/release')")
    return topic


def _amqp_nodes(b: dict[str, Any], host: str, port: int) -> tuple[tuple[str, int], ...]:
    """[broker] amqp_nodes: ["host:port", ...] (the AMQP listeners of the RabbitMQ nodes)."""
    raw = _get(b, "broker", "amqp_nodes", list, None)
    if raw is None:
        return ((host, port),)
    out = []
    for v in raw:
        m = re.fullmatch(r"(.+):([0-9]{1,5})", v) if isinstance(v, str) else None
        if m is None or not 0 < int(m.group(2)) < 65536:
            raise ConfigError("broker.amqp_nodes", "each entry must be a \"host:port\" string, got %r" % (v,))
        out.append((m.group(1), int(m.group(2))))
    if not out:
        raise ConfigError("broker.amqp_nodes", "must list at least one node")
    return tuple(out)


# -- loading ---------------------------------------------------------------
def from_dict(raw: dict[str, Any], base_dir: str = ".", path: Optional[str] = None) -> HostConfig:
    sec = tomlconf.sections(raw, SECTIONS)

    # [broker]
    b = sec("broker")
    ca, cert, key, tls_on = tomlconf.tls_files(b, "broker", base_dir)
    tls = bool(tls_on) or bool(ca) or bool(cert)
    pw = tomlconf.password(b, "broker", base_dir)
    broker = BrokerConfig(
        host=_get(b, "broker", "host", str, "localhost"),
        port=_int_range(b, "broker", "port", 8883 if tls else 1883, 1, 65535),
        tls=tls, tls_ca=ca, tls_cert=cert, tls_key=key,
        username=_get(b, "broker", "username", str, None),
        password=pw,
        client_id=_get(b, "broker", "client_id", str, ""),
        keepalive=_int_range(b, "broker", "keepalive", 60, 5, 65535),
        reconnect_min_s=_seconds(b, "broker", "reconnect_min_s", 1.0),
        reconnect_max_s=_seconds(b, "broker", "reconnect_max_s", 60.0),
    )
    if not broker.host:
        raise ConfigError("broker.host", "must not be empty")
    tomlconf.check_client("broker", broker.username, broker.password, broker.reconnect_min_s,
                          broker.reconnect_max_s)
    mv = _get(b, "broker", "mqtt_version", (str, int), "5")
    if str(mv) not in MQTT_VERSIONS:
        raise ConfigError("broker.mqtt_version", 'must be "5" or "3.1.1", got %r' % (mv,))
    broker.mqtt_version = MQTT_VERSIONS[str(mv)]
    broker.kind = _get(b, "broker", "kind", str, "mosquitto")
    if broker.kind not in ("mosquitto", "rabbitmq"):
        raise ConfigError("broker.kind", "must be 'mosquitto' or 'rabbitmq', got %r" % broker.kind)
    broker.amqp_nodes = _amqp_nodes(b, broker.host, 5671 if tls else 5672)
    broker.queue = _get(b, "broker", "queue", str, "pansketch.releases")
    if not re.fullmatch(r"[A-Za-z0-9_.:-]{1,200}", broker.queue) or broker.queue.startswith("amq."):
        raise ConfigError("broker.queue", "must be 1-200 letters, digits, '_', '.', ':' or '-', not amq.*")
    broker.vhost = _get(b, "broker", "vhost", str, "/")
    if len(broker.client_id.encode()) > 128:
        raise ConfigError("broker.client_id", "must be at most 128 bytes")

    # [aggregator]
    a = sec("aggregator")
    db = _get(a, "aggregator", "db", str, "pansketch.db")
    if not db:
        raise ConfigError("aggregator.db", "must be a file path or a postgresql:// URL")
    is_pg = db.startswith(("postgresql://", "postgres://"))
    if not is_pg and "://" in db:
        raise ConfigError("aggregator.db", "unsupported database URL scheme %r (use a SQLite file path or "
                                           "postgresql://user@host:port/dbname)" % db.split("://", 1)[0])
    shared = _get(a, "aggregator", "shared_group", str, "")
    if shared and not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", shared):
        raise ConfigError("aggregator.shared_group", "must be 1-64 letters, digits, '_', '.' or '-'")
    if shared and broker.mqtt_version != 5:
        raise ConfigError("aggregator.shared_group", "needs MQTT v5 ($share subscriptions): broker.mqtt_version is 3.1.1")
    agg = AggregatorConfig(
        db=db if is_pg else (_path(base_dir, db) or db),
        topic=_topic_filter(_get(a, "aggregator", "topic", str, DEFAULT_TOPIC), "aggregator.topic"),
        shared_group=shared,
        max_bytes=_int_range(a, "aggregator", "max_bytes", 1 << 20, 64, 256 << 20),
        qos=_int_range(a, "aggregator", "qos", 1, 0, 2),
        session_expiry_s=_int_range(a, "aggregator", "session_expiry_s",
                                    SHARED_SESSION_EXPIRY_S if shared else DEFAULT_SESSION_EXPIRY_S, 0, 0xFFFFFFFF),
        group_wait_ms=_int_range(a, "aggregator", "group_wait_ms", 200, 0, 1000),
        wal_limit_mb=_int_range(a, "aggregator", "wal_limit_mb", 64, 1, 1 << 20),
        drop_cache_behind_mb=_int_range(a, "aggregator", "drop_cache_behind_mb", 64, 0, 1 << 20),
        retain_raw_s=_int_range(a, "aggregator", "retain_raw_s", 0, 0, 100 * 365 * 86400),
    )
    agg.validate_cpu_s = _seconds(a, "aggregator", "validate_cpu_s", 1.0)
    if not 0.01 <= agg.validate_cpu_s <= 60:
        raise ConfigError("aggregator.validate_cpu_s", "must be between 0.01 and 60 seconds")
    agg.reject_keep_bytes = _int_range(a, "aggregator", "reject_keep_bytes", 256, 0, 1 << 16)
    agg.rejections_max_rows = _int_range(a, "aggregator", "rejections_max_rows", 10000, 10, 1 << 31)
    agg.rejections_max_bytes = _int_range(a, "aggregator", "rejections_max_bytes", 16 << 20, 1 << 16, 1 << 40)
    agg.rejections_retention_s = _seconds(a, "aggregator", "rejections_retention_s", 30 * 86400.0)
    agg.reject_log_interval_s = _seconds(a, "aggregator", "reject_log_interval_s", 60.0)
    agg.max_clock_skew_s = _seconds(a, "aggregator", "max_clock_skew_s", 600.0)
    agg.max_past_s = float(_get(a, "aggregator", "max_past_s", (int, float), MAX_PAST_S))
    if not agg.max_past_s >= 0:
        raise ConfigError("aggregator.max_past_s", "must be 0 (no bound) or a number of seconds")
    agg.max_seq_jump = _int_range(a, "aggregator", "max_seq_jump", 100000, 1, 1 << 32)
    agg.quarantine_max_rows = _int_range(a, "aggregator", "quarantine_max_rows", 1000, 1, 1 << 31)
    agg.quarantine_max_bytes = _int_range(a, "aggregator", "quarantine_max_bytes", 64 << 20, 1 << 16, 1 << 40)
    if agg.qos == 0:
        raise ConfigError("aggregator.qos", "must be 1 or 2 (QoS 0 can lose releases)")
    if 0 < agg.retain_raw_s < MIN_RETAIN_RAW_S:
        raise ConfigError("aggregator.retain_raw_s", "must be 0 (keep raw releases) or at least %d seconds (a "
                                                     "release is pruned only well after it is committed, rolled "
                                                     "up and acknowledged)" % MIN_RETAIN_RAW_S)

    # [fleet]
    fl = sec("fleet")
    salt = _get(fl, "fleet", "salt", str, None)
    sid = _get(fl, "fleet", "salt_id", str, None)
    if salt is None and sid is None:
        raise ConfigError("fleet.salt", "is required (the fleet's hash salt; or give salt_id = \"<16 hex>\" "
                                        "for an aggregator that does not answer queries)")
    if salt is not None:
        if len(salt) < 8 or len(salt.encode()) > hashing.MAX_SALT:
            raise ConfigError("fleet.salt", "must be 8 to 255 bytes (the same string as the devices' salt)")
        if sid is not None and sid != hashing.salt_id(salt):
            raise ConfigError("fleet.salt_id", "does not match fleet.salt (salt_id of that salt is %s)"
                              % hashing.salt_id(salt))
        sid = hashing.salt_id(salt)
    assert sid is not None
    if not re.fullmatch(r"[0-9a-f]{16}", sid):
        raise ConfigError("fleet.salt_id", "must be 16 lower-case hex digits")
    kind = _get(fl, "fleet", "kind", str, None)
    if kind is not None and kind not in KINDS and kind not in ("dcs", "dbits", "strhh"):
        raise ConfigError("fleet.kind", "must be 'cms', 'cs', 'dcs', 'dbits' or 'strhh', got %r" % kind)
    mech = _get(fl, "fleet", "mechanism", str, None)
    if mech is not None and mech not in MECHANISMS:
        raise ConfigError("fleet.mechanism", "must be 'dlap' or 'dgauss', got %r" % mech)
    fleet = FleetConfig(salt=salt, salt_id=sid, kind=kind,
                        d=_int_range(fl, "fleet", "d", None, 1, 32),
                        w=_int_range(fl, "fleet", "w", None, 2, 1 << 24), mechanism=mech,
                        max_events_per_window=_int_range(fl, "fleet", "max_events_per_window", DEFAULT_MAX_EVENTS,
                                                         1, MAX_MAX_EVENTS),
                        max_clip=_int_range(fl, "fleet", "max_clip", 1, 1, 1 << 20))
    for k in LIMIT_KINDS:
        v = _int_range(fl, "fleet", "max_events_per_window_" + k, None, 1, MAX_MAX_EVENTS)
        if v is not None:
            fleet.max_events_by_kind[k] = v

    # [query]
    q = sec("query")
    query = QueryConfig(confidence=_fraction_float(q, "query", "confidence", 0.95),
                        delta=_fraction_float(q, "query", "delta", 1e-6))
    if query.confidence < 0.5:
        raise ConfigError("query.confidence", "must be at least 0.5")
    # [status]
    stc = sec("status")
    status = StatusConfig(late_grace_s=_seconds(stc, "status", "late_grace_s", 0.0) if "late_grace_s" in stc
                          else None)
    # [store]
    store = StoreConfig(compress=_get(sec("store"), "store", "compress", bool, None))
    return HostConfig(broker=broker, aggregator=agg, fleet=fleet, query=query, status=status, store=store,
                      path=path)


# loads(text, base_dir=".", path=None) and load(path): parse and validate (raise ConfigError)
loads, load = tomlconf.loaders(from_dict)


def load_for_command(path: str) -> Optional[HostConfig]:
    """:func:`load` for a command's ``--config``: None where the file is unreadable or invalid, after the
    one-line ``pansketch: config error: ...`` on stderr (the command then exits 2)."""
    try:
        return load(path)
    except ConfigError as exc:
        print("pansketch: config error: %s" % exc, file=sys.stderr)
        return None


def load_for_subcommand(args: Any, prog: str) -> Optional[HostConfig]:
    """:func:`load_for_command` for a command whose ``--config`` may stand before its subcommand
    (``args.config``) or after it (``args.config_sub``): None, after one line on stderr, where it is
    missing, unreadable or invalid (the command then exits 2)."""
    path = getattr(args, "config_sub", None) or args.config
    if not path:
        print("%s: --config FILE is required" % prog, file=sys.stderr)
        return None
    return load_for_command(path)


def default_client_id(cfg: HostConfig) -> str:
    """Client id: configured, else stable for one aggregator, per-process with a shared group."""
    if cfg.broker.client_id:
        return cfg.broker.client_id
    if cfg.aggregator.shared_group:
        return "pansketch-agg-%s-%d-%s" % (socket.gethostname()[:40], os.getpid(), os.urandom(3).hex())
    return "pansketch-aggregator"
