"""Start a systemd unit's service the way systemd would, where there is no systemd (a test's namespace).

``python3 tests/support/unitrun.py start NAME`` reads /etc/systemd/system/NAME.service and does what
``systemctl start`` makes systemd do for its [Service] section, as far as the pansketch units use it:
StateDirectory and CacheDirectory (created, owned by User, their *DirectoryMode) and ConfigurationDirectory, the
environment systemd gives a system service (its PATH, HOME and USER of User=, LANG, the
*_DIRECTORY variables, Environment=), the working directory / , stdin from /dev/null, User= and
Group= with the user's supplementary groups, then ExecStartPre= (each must exit 0) and ExecStart=
in a session of its own; its output goes to $WORK/NAME.journal and its pid to $WORK/NAME.pid.

systemd reports a Type=simple service started as soon as it is forked; this waits 3 s and fails when
the service has exited by then (the operator would see it in ``systemctl status``). Not emulated: the
sandboxing options (ProtectSystem=, PrivateTmp=, ...), which only take rights away.
"""

from __future__ import annotations

import grp
import os
import pwd
import shlex
import subprocess
import sys
import time
from pathlib import Path

SYSTEMD_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def service_section(path: Path) -> list[tuple[str, str]]:
    """The [Service] section's key=value lines, in order (systemd allows repeated keys)."""
    out, section = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line
            continue
        if section == "[Service]" and "=" in line:
            k, v = line.split("=", 1)
            out.append((k.strip(), v.strip()))
    return out


def start(name: str, work: Path) -> int:
    unit = Path("/etc/systemd/system") / ("%s.service" % name)
    if not unit.exists():
        print("Failed to start %s.service: Unit %s.service not found." % (name, name), file=sys.stderr)
        return 5
    svc = service_section(unit)
    get = {k: v for k, v in svc}
    user = pwd.getpwnam(get.get("User", "root"))
    gid = grp.getgrnam(get["Group"]).gr_gid if "Group" in get else user.pw_gid
    env = {"PATH": SYSTEMD_PATH, "LANG": "C.UTF-8", "USER": user.pw_name, "LOGNAME": user.pw_name,
           "HOME": user.pw_dir, "SHELL": user.pw_shell, "INVOCATION_ID": os.urandom(16).hex()}
    for k, v in svc:
        if k == "Environment":
            for kv in shlex.split(v):
                env[kv.split("=", 1)[0]] = kv.split("=", 1)[1]
    for key, root, var in (("StateDirectory", "/var/lib", "STATE_DIRECTORY"),
                           ("CacheDirectory", "/var/cache", "CACHE_DIRECTORY")):
        if key in get:
            d = Path(root) / get[key]
            d.mkdir(parents=True, exist_ok=True)
            os.chown(d, user.pw_uid, gid)
            os.chmod(d, int(get.get(key + "Mode", "0755"), 8))
            env[var] = str(d)
    if "ConfigurationDirectory" in get:
        d = Path("/etc") / get["ConfigurationDirectory"]
        d.mkdir(parents=True, exist_ok=True)
        env["CONFIGURATION_DIRECTORY"] = str(d)

    def drop() -> None:
        os.setgid(gid)
        os.initgroups(user.pw_name, gid)
        os.setuid(user.pw_uid)

    journal = open(work / ("%s.journal" % name), "ab")
    for k, v in svc:
        if k == "ExecStartPre":
            r = subprocess.run(shlex.split(v.lstrip("-")), env=env, cwd="/", stdin=subprocess.DEVNULL,
                               stdout=journal, stderr=journal, preexec_fn=drop)
            if r.returncode != 0 and not v.startswith("-"):
                print("Job for %s.service failed: ExecStartPre=%s exited %d" % (name, v, r.returncode),
                      file=sys.stderr)
                return 1
    p = subprocess.Popen(shlex.split(get["ExecStart"]), env=env, cwd="/", stdin=subprocess.DEVNULL, stdout=journal,
                         stderr=journal, preexec_fn=drop, start_new_session=True)
    (work / ("%s.pid" % name)).write_text(str(p.pid))
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline and p.poll() is None:
        time.sleep(0.1)
    if p.poll() is not None:
        journal.flush()
        tail = (work / ("%s.journal" % name)).read_text(errors="replace")[-2000:]
        print("%s.service: ExecStart exited %d right after starting:\n%s" % (name, p.returncode, tail),
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "start":
        sys.exit("usage: unitrun.py start NAME")
    sys.exit(start(sys.argv[2].removesuffix(".service"), Path(os.environ["WORK"])))
