"""A throwaway PostgreSQL server for tests and benchmarks (Debian's ``postgresql`` package).

    srv = PgServer.start()          # initdb + pg_ctl into a temp dir, ~1 s
    dsn = srv.create_database("t1") # postgresql://postgres@127.0.0.1:<port>/t1
    sb = srv.standby()              # a streaming hot standby (pg_basebackup); sb.promote()
    srv.stop()

The server runs as the ``postgres`` user (via ``runuser``) when we are
root, listens on 127.0.0.1 on a free port with trust authentication, and
lives in a temporary directory removed by :meth:`stop`. :func:`binaries`
finds ``initdb``/``pg_ctl`` on PATH or under /usr/lib/postgresql/*/bin;
None when PostgreSQL is not installed (tests skip with that reason;
``.ci/run`` installs it).
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
from typing import Optional

from pansketch.host_tools.localnet import free_port, wait_port

MISSING = ("PostgreSQL server binaries (initdb, pg_ctl) not found: apt-get install postgresql "
           "(.ci/run installs it)")


def binaries() -> Optional[str]:
    """The directory holding initdb and pg_ctl, or None."""
    cands = []
    w = shutil.which("pg_ctl")
    if w:
        cands.append(os.path.dirname(os.path.realpath(w)))
    cands += sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)
    for d in cands:
        if os.access(os.path.join(d, "initdb"), os.X_OK) and os.access(os.path.join(d, "pg_ctl"), os.X_OK):
            return d
    return None


def _template(bindir: str, as_user: Optional[str]) -> str:
    """An initdb'd cluster to copy (cached in the temp dir, keyed by binaries and user)."""
    import hashlib

    key = hashlib.sha256(("%s|%s|%d" % (os.path.realpath(bindir), as_user, os.getuid())).encode()).hexdigest()[:12]
    base = os.path.join(tempfile.gettempdir(), "pansketch-pg-template-" + key)
    data = os.path.join(base, "data")
    if os.path.exists(os.path.join(data, "PG_VERSION")):
        return data
    os.makedirs(base, exist_ok=True)
    work = tempfile.mkdtemp(prefix="init-", dir=base)
    if as_user:
        import pwd

        pw = pwd.getpwnam(as_user)
        for d in (base, work):
            os.chown(d, pw.pw_uid, pw.pw_gid)
    wdata = os.path.join(work, "data")
    cmd = [os.path.join(bindir, "initdb"), "-D", wdata, "-A", "trust", "-U", "postgres", "-E", "UTF8",
           "--no-sync", "--no-instructions"]
    subprocess.run((["runuser", "-u", as_user, "--"] if as_user else []) + cmd,
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=120)
    try:
        os.rename(wdata, data)  # atomic: a concurrent starter either sees the whole cluster or none
    except OSError:
        if not os.path.exists(os.path.join(data, "PG_VERSION")):
            raise
    shutil.rmtree(work, ignore_errors=True)
    return data


class PgServer:
    def __init__(self, bindir: str, root: str, port: int, as_user: Optional[str]) -> None:
        self.bindir = bindir
        self.root = root
        self.data = os.path.join(root, "data")
        self.port = port
        self.as_user = as_user
        self.opts = ""

    def _cmd(self, *args: str) -> list[str]:
        if self.as_user:
            return ["runuser", "-u", self.as_user, "--"] + list(args)
        return list(args)

    @classmethod
    def start(cls, fsync: bool = False, max_connections: int = 100,
              settings: Optional[dict[str, str]] = None) -> "PgServer":
        bindir = binaries()
        if bindir is None:
            raise FileNotFoundError(MISSING)
        root = tempfile.mkdtemp(prefix="pansketch-pg-")
        as_user = None
        if hasattr(os, "geteuid") and os.geteuid() == 0:  # the server refuses to run as root
            import pwd

            pw = pwd.getpwnam("postgres")
            os.chown(root, pw.pw_uid, pw.pw_gid)
            as_user = "postgres"
        srv = cls(bindir, root, free_port(), as_user)
        try:
            tmpl = _template(bindir, as_user)  # initdb once per machine (~3 s), then copy (~0.1 s)
            subprocess.run(["cp", "-a", tmpl, srv.data], check=True, stderr=subprocess.PIPE, timeout=120)
            srv.opts = opts = ("-c listen_addresses=127.0.0.1 -p %d -k %s -c fsync=%s -c max_connections=%d "
                    "-c shared_buffers=64MB" % (srv.port, root, "on" if fsync else "off", max_connections))
            opts += "".join(" -c %s=%s" % kv for kv in sorted((settings or {}).items()))
            srv.opts = opts
            subprocess.run(srv._cmd(os.path.join(bindir, "pg_ctl"), "-D", srv.data, "-l",
                                    os.path.join(root, "server.log"), "-o", opts, "-w", "-t", "60", "start"),
                           check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=90)
        except subprocess.CalledProcessError as exc:
            log = ""
            try:
                with open(os.path.join(root, "server.log")) as f:
                    log = f.read()[-2000:]
            except OSError:
                pass
            shutil.rmtree(root, ignore_errors=True)
            raise RuntimeError("starting PostgreSQL failed: %s %s %s" % (exc, (exc.stderr or b"").decode()[-2000:], log))
        return srv

    def standby(self, name: str = "pansketch_standby") -> "PgServer":
        """A streaming hot standby of this server, on its own free port (``pg_basebackup -X stream -R``:
        a copy of the data directory plus ``standby.signal`` and ``primary_conninfo``). ``name`` is its
        ``cluster_name``, which its WAL receiver reports as ``application_name`` (what
        ``synchronous_standby_names`` lists)."""
        root = tempfile.mkdtemp(prefix="pansketch-pg-standby-")
        if self.as_user:
            import pwd

            pw = pwd.getpwnam(self.as_user)
            os.chown(root, pw.pw_uid, pw.pw_gid)
        srv = PgServer(self.bindir, root, free_port(), self.as_user)
        try:
            subprocess.run(srv._cmd(os.path.join(self.bindir, "pg_basebackup"), "-D", srv.data, "-h", "127.0.0.1",
                                    "-p", str(self.port), "-U", "postgres", "-X", "stream", "-R",
                                    "--checkpoint=fast", "--no-sync"),
                           check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=120)
            srv.opts = self.opts.replace("-p %d -k %s" % (self.port, self.root), "-p %d -k %s" % (srv.port, root)) + \
                " -c hot_standby=on -c cluster_name=%s" % name
            srv._pg_ctl("start", "-o", srv.opts, "-t", "60")
        except subprocess.CalledProcessError as exc:
            shutil.rmtree(root, ignore_errors=True)
            raise RuntimeError("starting a standby failed: %s %s" % (exc, (exc.stderr or b"").decode()[-2000:]))
        return srv

    def _pg_ctl(self, *args: str) -> None:
        subprocess.run(self._cmd(os.path.join(self.bindir, "pg_ctl"), "-D", self.data, "-l",
                                 os.path.join(self.root, "server.log"), "-w", *args),
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=90)

    def promote(self) -> None:
        """``pg_ctl promote``: the standby ends recovery and takes writes (waits until it does)."""
        self._pg_ctl("promote", "-t", "60")

    def crash(self) -> None:
        """``pg_ctl stop -m immediate``: every server process quits at once, no checkpoint (as a crash)."""
        self._pg_ctl("stop", "-m", "immediate")

    def dsn(self, dbname: str = "postgres") -> str:
        return "postgresql://postgres@127.0.0.1:%d/%s" % (self.port, dbname)

    def create_database(self, name: str) -> str:
        import psycopg

        with psycopg.connect(self.dsn(), autocommit=True) as c:
            c.execute('DROP DATABASE IF EXISTS "%s"' % name)
            c.execute('CREATE DATABASE "%s"' % name)
        return self.dsn(name)

    def stop(self, remove: bool = True) -> None:
        subprocess.run(self._cmd(os.path.join(self.bindir, "pg_ctl"), "-D", self.data, "-m", "fast", "-w", "stop"),
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60)
        if remove:
            shutil.rmtree(self.root, ignore_errors=True)

    def restart(self) -> None:
        subprocess.run(self._cmd(os.path.join(self.bindir, "pg_ctl"), "-D", self.data, "-l",
                                 os.path.join(self.root, "server.log"), "-o", self.opts, "-w", "start"),
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60)


def wait_ready(port: int, timeout: float = 10.0) -> None:
    wait_port(port, timeout, poll=0.05)
