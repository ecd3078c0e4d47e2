"""TOML config plumbing shared by ``pansketch.agent.pi.config`` and ``pansketch.host_tools.hostconfig``.

CPython only (not part of the MicroPython core). Every error is a
:class:`ConfigError` whose ``key`` is the dotted TOML key, so the commands
can print one line naming it and exit 2.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional, Protocol, TypeVar

try:  # Python >= 3.11
    import tomllib as _toml
except ImportError:  # pragma: no cover - Python 3.10
    import tomli as _toml  # type: ignore[no-redef, import-not-found]  # tomli is installed on 3.10 only


# Salts that appear in the examples and docs (examples/*.toml, deploy/board/*.json,
# README, docs/HOST.md). They work, but a fleet that keeps one shares its hash
# functions with every copy of the examples, and the salt cannot be changed
# later without starting a new history (releases with other salts never merge).
PLACEHOLDER_SALTS = ("change-me-fleet-salt", "our-fleet-salt-2026", "the-fleet-salt", "the fleet's shared salt")


def placeholder_salt_warning(key: str, salt: Optional[str], where: str) -> Optional[str]:
    """One warning line if ``salt`` is an example placeholder, else None."""
    if salt is None or salt not in PLACEHOLDER_SALTS:
        return None
    return ("%s is the example placeholder %r: set your fleet's own salt (the same %s) before the first real "
            "release; changing it later starts a new history (releases with different salts never merge)"
            % (key, salt, where))


class ConfigError(ValueError):
    """A bad configuration value; ``key`` is the dotted TOML key."""

    def __init__(self, key: str, msg: str) -> None:
        ValueError.__init__(self, "%s: %s" % (key, msg) if key else msg)
        self.key = key
        self.msg = msg


def type_name(typ: type | tuple[type, ...]) -> str:
    names = {str: "a string", int: "an integer", bool: "true or false", float: "a number"}
    if isinstance(typ, tuple):
        return " or ".join(names.get(t, t.__name__) for t in typ)
    return names.get(typ, typ.__name__)


def get(sec: dict[str, Any], secname: str, key: str, typ: type | tuple[type, ...], default: Any) -> Any:
    """``sec[key]`` checked against ``typ`` (booleans are not integers), or ``default``."""
    if key not in sec:
        return default
    v = sec[key]
    allow_bool = typ is bool or (isinstance(typ, tuple) and bool in typ)
    if isinstance(v, bool) and not allow_bool:
        raise ConfigError("%s.%s" % (secname, key), "must be %s, got a boolean" % type_name(typ))
    if not isinstance(v, typ):
        raise ConfigError("%s.%s" % (secname, key), "must be %s, got %r" % (type_name(typ), v))
    return v


def int_range(sec: dict[str, Any], secname: str, key: str, default: Any, lo: int, hi: int) -> Any:
    v = get(sec, secname, key, int, default)
    if v is not None and not lo <= v <= hi:
        raise ConfigError("%s.%s" % (secname, key), "must be between %d and %d, got %d" % (lo, hi, v))
    return v


def path(base: str, p: Optional[str]) -> Optional[str]:
    """``p`` with ``~`` expanded, relative to the config file's directory."""
    if p is None:
        return None
    p = os.path.expanduser(p)
    return p if os.path.isabs(p) else os.path.normpath(os.path.join(base, p))


def seconds(sec: dict[str, Any], secname: str, key: str, default: float) -> float:
    v = get(sec, secname, key, (int, float), default)
    if v <= 0:
        raise ConfigError("%s.%s" % (secname, key), "must be positive")
    return float(v)


def tls_files(sec: dict[str, Any], secname: str,
              base: str) -> tuple[Optional[str], Optional[str], Optional[str], Optional[bool]]:
    """(tls_ca, tls_cert, tls_key, tls) of a section that connects to a broker.

    The files are paths relative to the config's directory and must exist;
    a client certificate comes with its key; ``tls = false`` with files set
    is an error. ``tls`` is None when the key is absent.
    """
    ca = path(base, get(sec, secname, "tls_ca", str, None))
    cert = path(base, get(sec, secname, "tls_cert", str, None))
    key = path(base, get(sec, secname, "tls_key", str, None))
    if (cert is None) != (key is None):
        raise ConfigError(secname + (".tls_key" if key is None else ".tls_cert"),
                          "tls_cert and tls_key go together (client certificate and its key)")
    for k, p in (("tls_ca", ca), ("tls_cert", cert), ("tls_key", key)):
        if p is not None and not os.path.isfile(p):
            raise ConfigError("%s.%s" % (secname, k), "file not found: %s" % p)
    on = get(sec, secname, "tls", bool, None)
    if on is False and (ca or cert):
        raise ConfigError(secname + ".tls", "is false but tls_ca/tls_cert are set")
    return ca, cert, key, on


def password(sec: dict[str, Any], secname: str, base: str) -> Optional[str]:
    """``password``, or the first line of ``password_file`` (relative to the config's directory); not both."""
    pw = get(sec, secname, "password", str, None)
    pf = path(base, get(sec, secname, "password_file", str, None))
    if pw is not None and pf is not None:
        raise ConfigError(secname + ".password_file", "give either password or password_file, not both")
    if pf is not None:
        try:
            with open(pf, encoding="utf-8") as f:
                pw = f.read().strip()
        except OSError as exc:
            raise ConfigError(secname + ".password_file", "cannot read %s: %s" % (pf, exc.strerror))
    return pw


def parse(text: str) -> dict[str, Any]:
    try:
        return _toml.loads(text)
    except _toml.TOMLDecodeError as exc:
        raise ConfigError("", "not valid TOML: %s" % exc)


def read(path_: str) -> tuple[dict[str, Any], str]:
    """Parse a TOML file; returns (tables, directory of the file)."""
    try:
        with open(path_, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise ConfigError("", "cannot read %s: %s" % (path_, exc.strerror or exc))
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError("", "%s is not UTF-8 text" % path_)
    return parse(text), os.path.dirname(os.path.abspath(path_))


def check_sections(raw: dict[str, Any], sections: dict[str, Any]) -> None:
    """Unknown sections or keys are errors: typos must not pass silently."""
    for secname, sec in raw.items():
        if secname not in sections:
            raise ConfigError(secname, "unknown section (known: %s)" % ", ".join("[%s]" % s for s in sections))
        if not isinstance(sec, dict):
            raise ConfigError(secname, "must be a table ([%s])" % secname)
        for key in sec:
            if key not in sections[secname]:
                raise ConfigError("%s.%s" % (secname, key),
                                  "unknown key (known in [%s]: %s)" % (secname, ", ".join(sections[secname])))


def sections(raw: dict[str, Any], known: dict[str, Any]) -> Callable[[str], dict[str, Any]]:
    """:func:`check_sections`, then a getter of one section's table ({} when the section is absent)."""
    check_sections(raw, known)

    def sec(name: str) -> dict[str, Any]:
        return raw.get(name, {})

    return sec


def check_client(secname: str, username: Optional[str], password: Optional[str], reconnect_min_s: float,
                 reconnect_max_s: float) -> None:
    """The checks every broker client section shares (the agent's and the host's [broker])."""
    if reconnect_max_s < reconnect_min_s:
        raise ConfigError(secname + ".reconnect_max_s", "must be at least reconnect_min_s")
    if password is not None and username is None:
        raise ConfigError(secname + ".username", "is required when a password is set")


C = TypeVar("C")
C_co = TypeVar("C_co", covariant=True)


class Loads(Protocol[C_co]):
    def __call__(self, text: str, base_dir: str = ".", path: Optional[str] = None) -> C_co: ...


def loaders(from_dict: Callable[[dict[str, Any], str, Optional[str]], C]) -> tuple[Loads[C], Callable[[str], C]]:
    """(loads, load) of a config whose ``from_dict(raw, base_dir, path)`` validates the tables:
    ``loads(text, base_dir=".", path=None)`` parses TOML text, ``load(path)`` reads a file
    (relative paths in it are relative to its directory); both raise :class:`ConfigError`."""

    def loads(text: str, base_dir: str = ".", path: Optional[str] = None) -> C:
        return from_dict(parse(text), base_dir, path)

    def load(path_: str) -> C:
        raw, base_dir = read(path_)
        return from_dict(raw, base_dir, path_)

    return loads, load
