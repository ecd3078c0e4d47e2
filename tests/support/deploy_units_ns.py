"""deploy/OPERATIONS.md steps 3 and 4 as written, on top of steps 1-2, in a private mount and network
namespace (run as root by tests/test_deploy_units.py): the aggregator host's install, its units started
as systemd would start them (tests/support/unitrun.py: user, environment, directories), then a device's.

/etc, /opt, /usr/local and /var/lib are overlays whose writes stay in this namespace, so the doc's
``python3 -m venv /opt/pansketch``, ``useradd``, ``ln -sf ... /usr/local/bin`` and /etc/pansketch
change nothing outside it. The namespace has no network: pip installs from the packages
tests/test_deploy_units.py fetched beforehand. Only apt, systemctl and journalctl are replaced by their effect (the
mosquitto shims of tests/support/deploy_ns.py; a pansketch unit is started by tests/support/unitrun.py). Checks:
each unit answers -- the aggregator subscribed, the dashboard's /healthz says ok, the agent's
ExecStartPre check passed and its ExecStart is running and connected -- and every unit's
Documentation= names a file that the install put there.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import deploy_ns as ns
from deploy_ns import check

REPO = ns.REPO
UNITS = ("pansketch-aggregator", "pansketch-dashboard", "pansketch-agent")

# systemctl for the pansketch units (tests/support/unitrun.py), the mosquitto shim for the rest; journalctl shows
# what a unit wrote (no -f: the test goes on)
UNIT_SHIMS = r'''
eval "$(declare -f systemctl | sed '1s/^systemctl/_mq_systemctl/')"
systemctl() {
  case "$*" in
    daemon-reload) return 0 ;;
    "enable --now pansketch-"*|"start pansketch-"*|"restart pansketch-"*)
      "$UNIT_PY" "$UNITRUN" start "${@: -1}" ;;
    *) _mq_systemctl "$@" ;;
  esac
}
journalctl() { u=""; while [ $# -gt 0 ]; do [ "$1" = -u ] && u=$2; shift; done; tail -n 20 "$WORK/$u.journal"; }
'''


def overlay(work: Path, target: str) -> None:
    """Writes under ``target`` go to a tmpfs upper layer of this namespace; reads see the host's files."""
    base = work / "ovl" / target.strip("/").replace("/", "-")
    for d in ("up", "work"):
        (base / d).mkdir(parents=True)
    subprocess.run(["mount", "-t", "overlay", "overlay", "-o", "lowerdir=%s,upperdir=%s,workdir=%s"
                    % (target, base / "up", base / "work"), target], check=True)


def checkout(dst: Path) -> None:
    """The repository's tracked files, as a fresh checkout has them."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    for rel in files.decode().split("\0"):
        if rel and (REPO / rel).is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, dst / rel, follow_symlinks=False)


def steps(doc: str, n: int) -> str:
    return ns.doc_steps(doc, (n,))


def bash(work: Path, co: Path, script: str, name: str, timeout: float = 600) -> subprocess.CompletedProcess:
    (work / name).write_text(ns.SHIMS + UNIT_SHIMS + script + "\n")
    env = dict(os.environ, WORK=str(work), UNITRUN=str(REPO / "tests" / "support" / "unitrun.py"), UNIT_PY=sys.executable)
    for k in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME"):
        env.pop(k, None)
    env["PATH"] = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"  # root's, no venv
    if os.environ.get("PANSKETCH_WHEELHOUSE"):  # no network here: the packages the test fetched beforehand
        env.update(PIP_FIND_LINKS=os.environ["PANSKETCH_WHEELHOUSE"], PIP_NO_INDEX="1")
    return subprocess.run(["bash", str(work / name)], cwd=co, env=env, capture_output=True, text=True, timeout=timeout)


def journal(work: Path, unit: str) -> str:
    p = work / ("%s.journal" % unit)
    return p.read_text(errors="replace") if p.exists() else ""


def alive(work: Path, unit: str) -> bool:
    p = work / ("%s.pid" % unit)
    return p.exists() and os.path.exists("/proc/%s" % p.read_text().strip())


def stop_units(work: Path) -> None:
    for unit in UNITS:
        p = work / ("%s.pid" % unit)
        if p.exists():
            try:
                os.killpg(int(p.read_text()), signal.SIGTERM)
            except (ProcessLookupError, ValueError):
                pass


def run(work: Path) -> int:
    subprocess.run(["mount", "--make-rprivate", "/"], check=True)
    (work / "ovl").mkdir()
    # the overlays' upper layers on a tmpfs: an overlay cannot have its upper layer on another overlay
    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(work / "ovl")], check=True)
    for target in ("/etc", "/opt", "/usr/local", "/var/lib"):
        overlay(work, target)
    ns.setup(work)  # the stock mosquitto configuration, /run, /etc/hosts; checkout/deploy
    co = work / "checkout"
    checkout(co)
    doc = ns.DOC.read_text()

    r = bash(work, co, steps(doc, 1) + "\n" + steps(doc, 2), "steps-1-2.sh", 300)
    if not check("doc-steps-1-2", r.returncode == 0, "exit %d\n%s" % (r.returncode, (r.stdout + r.stderr)[-2000:])):
        return 1

    # the aggregator host
    r = bash(work, co, steps(doc, 3), "step-3.sh")
    check("doc-step-3", r.returncode == 0, "exit %d\n%s" % (r.returncode, (r.stdout + r.stderr)[-4000:]))
    agg = ns.wait_until(lambda: "subscribed to pansketch/+/release" in journal(work, "pansketch-aggregator"), 30)
    check("aggregator-subscribed", agg and alive(work, "pansketch-aggregator"),
          "journal: %s" % journal(work, "pansketch-aggregator")[-1500:])
    health = ""
    try:  # with the token the doc's step wrote, as a reverse proxy or a browser would send it
        token = Path("/etc/pansketch/dashboard.token").read_text().strip()
        req = urllib.request.Request("http://127.0.0.1:8080/healthz", headers={"Authorization": "Bearer " + token})
        with urllib.request.urlopen(req, timeout=10) as resp:
            health = "%d %s" % (resp.status, resp.read().decode())
    except Exception as exc:  # reported in the check
        health = repr(exc)
    check("dashboard-healthz", health.startswith("200") and '"ok": true' in health.replace('"ok":true', '"ok": true'),
          "GET /healthz: %s; journal: %s" % (health, journal(work, "pansketch-dashboard")[-1500:]))
    stop_units(work)

    # a device: what the operator edits in its files from step 2 ([source]), then step 4
    acfg = co / "pansketch-creds" / "pi-kitchen" / "agent.toml"
    acfg.write_text(re.sub(r'\[source\]\ntype = "stdin"\n', '[source]\ntype = "file"\npath = "/var/lib/pansketch/'
                           'events.log"\n', acfg.read_text()))
    r = bash(work, co, steps(doc, 4), "step-4.sh")
    check("doc-step-4", r.returncode == 0, "exit %d\n%s" % (r.returncode, (r.stdout + r.stderr)[-4000:]))
    up = ns.wait_until(lambda: "connected to" in journal(work, "pansketch-agent"), 20)
    check("agent-running", up and alive(work, "pansketch-agent"),
          "journal: %s" % journal(work, "pansketch-agent")[-1500:])
    stop_units(work)

    for unit in UNITS:
        text = (co / "deploy" / "systemd" / ("%s.service" % unit)).read_text()
        docs = re.findall(r"^Documentation=(.*)$", text, re.M)
        paths = [u[len("file://"):] for d in docs for u in d.split() if u.startswith("file://")]
        check("documentation-%s" % unit, bool(docs) and all(os.path.isfile(p) for p in paths),
              "Documentation= %s: %s" % (docs, {p: os.path.isfile(p) for p in paths}))
    print("RESULT %s" % ("FAIL " + ",".join(ns.FAILED) if ns.FAILED else "ok"), flush=True)
    return 1 if ns.FAILED else 0


def main() -> int:
    work = Path(sys.argv[1]).resolve()
    try:
        return run(work)
    finally:
        stop_units(work)
        pidfile = work / "mosquitto.shim.pid"
        if pidfile.exists() and pidfile.read_text().strip():
            try:
                os.kill(int(pidfile.read_text()), signal.SIGTERM)
            except (ProcessLookupError, ValueError):
                pass
        time.sleep(0.5)


if __name__ == "__main__":
    sys.exit(main())
