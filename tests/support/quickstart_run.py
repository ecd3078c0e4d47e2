"""The README's Quick start, run for real: one broker, ``pansketch aggregate`` on examples/host.toml,
``pansketch-agent check`` and ``feed`` on examples/agent.toml, then ``status`` and ``query freq``.

Used three ways: ``python -m tests.support.quickstart_run --write-readme`` puts the outputs of a real run into
README.md (between its ``<!-- quickstart:NAME -->`` markers); tests/test_readme_outputs.py runs it and
compares what it prints with what the README shows and explains; tests/test_wheel_install.py runs it
with an installed package's commands in a directory ``pansketch init`` filled.

The broker is the demo's (mosquitto when installed, else amqtt, MQTT 3.1.1) on a free port; the
configs are used as the user has them, with only ``port`` (and for amqtt ``mqtt_version``) changed,
and the outputs show port 1883 again, with the run's directory as ``…``.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[2]
EVENTS = "aa:bb:cc:01\naa:bb:cc:02\naa:bb:cc:01\n"  # the README's printf
ITEMS = ("aa:bb:cc:01", "aa:bb:cc:02", "aa:bb:cc:03")

# (name, shown command) in the README's order; "aggregate" is the other terminal's output
COMMANDS = (
    ("aggregate", "pansketch aggregate --config examples/host.toml"),
    ("check", "pansketch-agent check --config examples/agent.toml"),
    ("feed", "printf '%s' | pansketch-agent feed --config examples/agent.toml" % EVENTS.replace("\n", "\\n")),
    ("status", "pansketch status --config examples/host.toml"),
    ("freq", "pansketch query --config examples/host.toml freq %s" % " ".join(ITEMS)),
    ("freq-json", "pansketch query --config examples/host.toml freq %s --json" % ITEMS[0]),
)


def _configure(d: Path, port: int, mqtt311: bool) -> None:
    for name in ("host.toml", "agent.toml"):
        p = d / "examples" / name
        text = re.sub(r"^port = 1883\b", "port = %d" % port, p.read_text(), count=1, flags=re.M)
        if mqtt311:
            text = text.replace("[broker]", '[broker]\nmqtt_version = "3.1.1"', 1)
        p.write_text(text)


def run(cwd: Path, bindir: Optional[Path] = None, timeout: float = 120) -> dict[str, str]:
    """Run the Quick start in ``cwd`` (which has examples/host.toml and examples/agent.toml) with the
    ``pansketch`` commands of ``bindir`` (default: this interpreter's). Returns name -> output as shown."""
    from pansketch.host_tools.demo import start_broker

    bindir = bindir or Path(sys.executable).parent
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = str(bindir) + os.pathsep + env.get("PATH", "")
    env["COLUMNS"] = "200"
    work = Path(tempfile.mkdtemp(prefix="quickstart-broker-"))
    broker = start_broker(str(work), "auto")
    saved = {n: (cwd / "examples" / n).read_text() for n in ("host.toml", "agent.toml")}
    out: dict[str, str] = {}
    agg = None
    try:
        _configure(cwd, broker.port, broker.protocol != 5)
        log = open(work / "aggregate.log", "w+")
        agg = subprocess.Popen([str(bindir / "pansketch"), "aggregate", "--config", "examples/host.toml"],
                               cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 30
        while "subscribed to" not in (work / "aggregate.log").read_text() and time.monotonic() < deadline:
            if agg.poll() is not None:
                raise RuntimeError("pansketch aggregate exited %d:\n%s" % (agg.returncode,
                                                                           (work / "aggregate.log").read_text()))
            time.sleep(0.05)

        def sh(argv: list[str], stdin: str = "") -> str:
            r = subprocess.run([str(bindir / argv[0])] + argv[1:], cwd=cwd, env=env, input=stdin,
                               capture_output=True, text=True, timeout=timeout)
            if r.returncode != 0:
                raise RuntimeError("%s exited %d:\n%s%s" % (" ".join(argv), r.returncode, r.stdout, r.stderr))
            return r.stdout + r.stderr

        out["check"] = sh(["pansketch-agent", "check", "--config", "examples/agent.toml"])
        out["feed"] = sh(["pansketch-agent", "feed", "--config", "examples/agent.toml"], EVENTS)
        deadline = time.monotonic() + 10
        while " stored " not in (work / "aggregate.log").read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        out["status"] = sh(["pansketch", "status", "--config", "examples/host.toml"])
        out["freq"] = sh(["pansketch", "query", "--config", "examples/host.toml", "freq", *ITEMS])
        out["freq-json"] = sh(["pansketch", "query", "--config", "examples/host.toml", "freq", ITEMS[0], "--json"])
        agg.send_signal(signal.SIGINT)
        agg.wait(30)
        out["aggregate"] = (work / "aggregate.log").read_text()
    finally:
        if agg is not None and agg.poll() is None:
            agg.kill()
            agg.wait()
        for n, text in saved.items():
            (cwd / "examples" / n).write_text(text)
        broker.stop()
        shutil.rmtree(work, ignore_errors=True)
    return {k: shown(v, cwd, broker.port) for k, v in out.items()}


def shown(text: str, cwd: Path, port: int) -> str:
    """An output as the README shows it: port 1883, the run's directory as …, the aggregator's lines
    about its shutdown dropped (the README stops where the user presses Ctrl-C)."""
    text = text.replace(":%d" % port, ":1883").replace(str(cwd.resolve()), "…").replace(str(cwd), "…")
    lines = [ln for ln in text.splitlines()
             if not re.search(r"stopping|stopped|signal|Ctrl-C|exiting|aggregator\.summary", ln)]
    return "\n".join(ln if len(ln) <= WIDTH else ln[:WIDTH - 1] + "…" for ln in lines).rstrip() + "\n"


WIDTH = 170  # longer lines are cut at … in the README (the JSON line and the warnings)


def readme_blocks(outputs: dict[str, str]) -> dict[str, str]:
    """name -> the text of the README's marked block: the shown command, then its output."""
    return {name: "$ %s\n%s" % (cmd, outputs[name]) for name, cmd in COMMANDS}


MARK = re.compile(r"(<!-- quickstart:([a-z-]+) -->\n```console\n)(.*?)(```\n)", re.S)


def write_readme(path: Path, outputs: dict[str, str]) -> None:
    blocks = readme_blocks(outputs)
    text = path.read_text()
    path.write_text(MARK.sub(lambda m: m.group(1) + blocks[m.group(2)] + m.group(4), text))


def readme_shown(path: Path) -> dict[str, str]:
    """name -> the output the README shows under that command (the command line itself dropped)."""
    return {m.group(2): m.group(3).split("\n", 1)[1] for m in MARK.finditer(path.read_text())}


def main() -> int:
    if sys.argv[1:] != ["--write-readme"]:
        print("usage: python -m tests.support.quickstart_run --write-readme", file=sys.stderr)
        return 2
    d = Path(tempfile.mkdtemp(prefix="quickstart-"))
    try:
        shutil.copytree(REPO / "examples", d / "examples")
        write_readme(REPO / "README.md", run(d))
    finally:
        shutil.rmtree(d, ignore_errors=True)
    print("README.md: Quick start outputs rewritten from a real run")
    return 0


if __name__ == "__main__":
    sys.exit(main())
