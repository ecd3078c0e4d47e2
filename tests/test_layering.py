"""The code's layering, read from the source with ``ast``.

Every ``import`` / ``from ... import`` counts, also those inside functions
and ``TYPE_CHECKING`` blocks. Asserted:

* no import cycles in agent/, firmware/ or host_tools/;
* the device code never imports the host code;
* the board/Pi line: the modules directly in agent/ are the portable core,
  exactly the set firmware/manifest.py freezes, and import only modules
  MicroPython has (PORTABLE; no numpy, threading, paho, typing, dataclasses,
  nothing of agent/pi/ -- the CPython-only daemon -- save CPYTHON_PATH);
* host code imports the core freely (it is the contract: hashing, release
  format, noise) but agent/pi/ only where HOST_USES_PI lists it;
* the host packages depend one way: web -> query -> store, ingest -> store,
  and nothing imports web, bench or the lab except the entry points
  (pansketch.host_tools.cli, pansketch.host_tools.demo) -- see ALLOWED below;
* every package ``__init__`` has a docstring: its role and what it may import;
* at most 8 modules directly in host_tools/;
* the installed code imports nothing of tests/ (but the benchmarks in USES_TESTS);
* no test module imports another (shared code is in tests/support/);
* the fake board modules of the two MicroPython VMs are one set: the Unix-port
  board's (tests/mpunix/fakes) are links to tests/mpfakes, beside its own
  ``fakehw`` (the hardware behind them).

``python tests/test_layering.py`` prints the cycles and the edges between
host packages.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import Iterable

from tests.support.freeze import run_manifest

ROOT = Path(__file__).resolve().parent.parent
TREES = ("agent", "firmware", "host_tools")

# Host "roles": a subpackage of host_tools, or a module directly in it. A role
# may import agent, itself and the roles listed here (nothing else of the
# project). cli and demo are the entry points and may import anything.
SHARED = {"pansketch.host_tools.hostconfig", "pansketch.host_tools.fasthash", "pansketch.host_tools.logsetup", "pansketch.host_tools.cborscan",
          "pansketch.host_tools.localnet", "pansketch.host_tools.output"}
ALLOWED: dict[str, set[str]] = {
    "pansketch.host_tools.store": SHARED,
    "pansketch.host_tools.ingest": SHARED | {"pansketch.host_tools.store", "pansketch.host_tools.metrics"},
    "pansketch.host_tools.query": SHARED | {"pansketch.host_tools.store"},
    # the Prometheus exporters: the aggregator's (fed by ingest) and the store's (gaps from query.status)
    "pansketch.host_tools.metrics": SHARED | {"pansketch.host_tools.store", "pansketch.host_tools.query"},
    "pansketch.host_tools.web": SHARED | {"pansketch.host_tools.query", "pansketch.host_tools.store", "pansketch.host_tools.metrics"},
    # a product command: the privacy ledger's accounting (store) and the query commands' output helpers
    "pansketch.host_tools.audit": SHARED | {"pansketch.host_tools.store", "pansketch.host_tools.query"},
    "pansketch.host_tools.lab": SHARED,
    # the benchmarks drive every layer (and compare against the lab's algorithms)
    "pansketch.host_tools.bench": SHARED | {"pansketch.host_tools.ingest", "pansketch.host_tools.store", "pansketch.host_tools.query", "pansketch.host_tools.lab"},
    # what a user installs: the board fit check reads the firmware's memory model
    "pansketch.host_tools.provision": set(),
    "pansketch.host_tools.output": set(),
    "pansketch.host_tools.hostconfig": set(),
    "pansketch.host_tools.fasthash": set(),
    "pansketch.host_tools.logsetup": {"pansketch.host_tools.output"},  # log lines of device text go through textsafe
    "pansketch.host_tools.cborscan": set(),
    "pansketch.host_tools.localnet": set(),
    "pansketch.host_tools.cli": {"*"},
    "pansketch.host_tools.demo": {"*"},
}
MAX_TOP_MODULES = 8

# What a core module (agent/*.py, frozen onto boards) may import besides other core modules:
# modules that exist in MicroPython's standard set with the behaviour the core relies on.
PORTABLE = {"array", "struct", "sys", "hashlib", "os", "math", "gc", "time", "json", "micropython",
            "uctypes"}  # uctypes: MicroPython's own (agent/wipe.py; absent on CPython, guarded)
# Imports on CPython's path only, each behind a guard a board never passes (module -> imports).
CPYTHON_PATH: dict[str, set[str]] = {
    "pansketch.agent.hashing": {"_sha2", "_sha256"},  # the builtin SHA-256 when OpenSSL's is slower, inside try
    "pansketch.agent.sketch": {"pansketch.agent.pi.fastupdate"},  # the per-event closure, under the ``_WORDS`` guard
}
# The host roles that use the Pi daemon's modules, and which (a config parser, the publisher's
# topics and ack format, the batch path the benchmarks time).
HOST_USES_PI: dict[str, set[str]] = {
    "pansketch.host_tools.audit": {"pansketch.agent.pi.config"},  # reads an agent's TOML to replay its recorder
    "pansketch.host_tools.bench": {"pansketch.agent.pi.batch", "pansketch.agent.pi.plan"},  # times the daemon's batch path; its noise model
    "pansketch.host_tools.cli": {"pansketch.agent.pi.pipes"},  # the same SIGPIPE/EPIPE handling as pansketch-agent
    "pansketch.host_tools.demo": {"pansketch.agent.pi.config", "pansketch.agent.pi.publisher"},  # runs simulated Pi agents
    "pansketch.host_tools.hostconfig": {"pansketch.agent.pi.tomlconf"},  # one TOML reader for agent and host configs
    "pansketch.host_tools.ingest": {"pansketch.agent.pi.publisher", "pansketch.agent.pi.tomlconf"},  # topic/ack contract; the TOML reader
    "pansketch.host_tools.fasthash": {"pansketch.agent.pi.hashvec"},  # hash version 1's row rule in numpy, one copy
    "pansketch.host_tools.lab": {"pansketch.agent.pi.hashvec"},
}


def modules(root: Path = ROOT, trees: Iterable[str] = TREES) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of the trees."""
    out: dict[str, Path] = {}
    for tree in trees:
        for f in sorted((root / tree).rglob("*.py")):
            parts = list(f.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(["pansketch"] + parts)] = f
    return out


def _resolve(name: str, mods: dict[str, Path]) -> str | None:
    """The longest prefix of a dotted name that is a module of ours."""
    parts = name.split(".")
    while parts:
        cand = ".".join(parts)
        if cand in mods:
            return cand
        parts.pop()
    return None


def imports(mod: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """The project modules that ``mod`` imports, anywhere in its file."""
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for a in node.names:
                t = _resolve(a.name, mods)
                if t:
                    out.add(t)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = mod.split(".")
                if not is_pkg:
                    base.pop()
                base = base[:len(base) - (node.level - 1)]
                pkg = ".".join(base + ([node.module] if node.module else []))
            else:
                pkg = node.module or ""
            for a in node.names:  # `from pkg import sub` imports the module pkg.sub when there is one
                t = _resolve(pkg + "." + a.name, mods) if a.name != "*" else None
                t = t if t and t != _resolve(pkg, mods) else _resolve(pkg, mods)
                if t:
                    out.add(t)
    out.discard(mod)
    return out


def graph(root: Path = ROOT) -> dict[str, set[str]]:
    mods = modules(root)
    return {m: imports(m, p, mods) for m, p in mods.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for start in sorted(g):
        if start in index:
            continue
        work = [(start, iter(sorted(g[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in g:
                    continue
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(g[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return sorted(out)


def role(mod: str) -> str | None:
    """host_tools.<first part> for host modules, None elsewhere."""
    parts = mod.split(".")[1:]  # after pansketch.
    if not parts or parts[0] != "host_tools" or len(parts) < 2:
        return None
    return "pansketch.host_tools." + parts[1]


def violations(g: dict[str, set[str]]) -> list[str]:
    """Imports that break the layering rules, one line each."""
    out = []
    for m, deps in sorted(g.items()):
        top = m.split(".")[1]
        r = role(m)
        for d in sorted(deps):
            dtop = d.split(".")[1]
            if top in ("agent", "firmware") and dtop == "host_tools":
                out.append("%s -> %s: device code never imports the host" % (m, d))
            if top == "agent" and dtop == "firmware":
                out.append("%s -> %s: agent is the board-independent core" % (m, d))
            if r is None or dtop != "host_tools":
                continue
            dr = role(d)
            if dr is None or dr == r:
                continue
            allowed = ALLOWED.get(r)
            if allowed is None:
                out.append("%s: %s is not a known role (add it to ALLOWED with its dependencies)" % (m, r))
            elif "*" not in allowed and dr not in allowed:
                out.append("%s -> %s: %s may import only %s" % (m, d, r, ", ".join(sorted(allowed)) or "agent"))
    return out


def frozen_agent_files(root: Path = ROOT) -> set[str]:
    """The agent/ files firmware/manifest.py freezes (run as MicroPython's freezer runs it)."""
    return {f[len("agent/"):] for pkg, files, _base in run_manifest(root)["package"] if pkg == "pansketch"
            for f in files if f.startswith("agent/")}


def core_violations(root: Path = ROOT) -> list[str]:
    """Core modules' imports of anything MicroPython lacks, one line each (every import counts,
    also inside functions)."""
    mods = modules(root, ("agent",))
    core = {m for m, p in mods.items() if p.parent == root / "agent"}
    out = []
    for m in sorted(core):
        for node in ast.walk(ast.parse(mods[m].read_text(), str(mods[m]))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
                if node.module in ("pansketch.agent", "pansketch.agent.pi"):  # `from pansketch.agent.pi import x` imports pansketch.agent.pi.x
                    names = [node.module + "." + a.name for a in node.names]
            else:
                continue
            for n in names:
                ok = (n in PORTABLE or n.split(".")[0] in PORTABLE or _resolve(n, mods) in core
                      or n in CPYTHON_PATH.get(m, ()))
                if not ok:
                    out.append("%s imports %s: the core runs on MicroPython" % (m, n))
    return out


def host_pi_violations(g: dict[str, set[str]]) -> list[str]:
    """Host imports of agent/pi/ modules not listed in HOST_USES_PI."""
    out = []
    for m, deps in sorted(g.items()):
        r = role(m)
        for d in sorted(deps):
            if r and d.startswith("pansketch.agent.pi") and d not in HOST_USES_PI.get(r, set()):
                out.append("%s -> %s: host code uses the Pi daemon only where HOST_USES_PI says" % (m, d))
    return out


# -- the tests -----------------------------------------------------------------
def test_frozen_set_is_the_core_folder():
    """One rule for what goes on a board: every module directly in agent/, nothing of agent/pi/."""
    folder = {p.name for p in (ROOT / "agent").glob("*.py")}
    assert frozen_agent_files() == folder
    assert (ROOT / "agent" / "pi" / "__init__.py").is_file()


def test_core_imports_only_portable_modules():
    bad = core_violations()
    assert not bad, "\n".join(bad)


def test_host_uses_the_pi_daemon_only_where_listed():
    bad = host_pi_violations(graph())
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    found = cycles(graph())
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_dependencies_point_one_way():
    bad = violations(graph())
    assert not bad, "layering violations:\n" + "\n".join(bad)


def test_every_host_role_is_known():
    roles = {role(m) for m in modules() if role(m)}
    roles.discard("pansketch.host_tools.__init__")
    assert roles <= set(ALLOWED), "roles without rules: %s" % sorted(roles - set(ALLOWED))


def test_package_inits_say_role_and_imports():
    """Each package __init__ has a docstring (its role) that says what the package may import."""
    missing = [str(p.relative_to(ROOT)) for m, p in modules().items()
               if p.name == "__init__.py" and "import" not in (ast.get_docstring(ast.parse(p.read_text())) or "")]
    assert not missing, "package __init__ whose docstring does not say what it may import: %s" % missing


# The installed code that still drives a test helper (the WebAssembly MicroPython VM under node, for
# the device-cost figures of ``make bench``): a benchmark, run from a checkout. Nothing else installed
# imports tests.
USES_TESTS = {"pansketch.host_tools.bench.core"}


def test_installed_code_does_not_import_the_tests():
    users = set()
    for m, p in modules().items():
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            if any(n == "tests" or n.startswith("tests.") for n in names):
                users.add(m)
    assert users <= USES_TESTS, "installed modules importing the tests: %s" % sorted(users - USES_TESTS)


def test_no_test_module_imports_another():
    """What two test modules share lives in tests/support/, so each test file can be read, run and
    moved on its own."""
    found = []
    for p in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            found += ["%s imports %s" % (p.relative_to(ROOT), n) for n in names
                      if n.startswith("tests.test_") or n.split(".")[-1].startswith("test_") and n.startswith("tests")]
    assert not found, found


def test_few_modules_directly_in_host_tools():
    top = sorted(p.name for p in (ROOT / "host_tools").glob("*.py") if p.name != "__init__.py")
    assert len(top) <= MAX_TOP_MODULES, top


def test_checker_sees_cycles_and_violations(tmp_path):
    """The checker itself: a cycle through a function-level import and an upward import are found."""
    (tmp_path / "host_tools" / "store").mkdir(parents=True)
    (tmp_path / "host_tools" / "web").mkdir()
    (tmp_path / "agent").mkdir()
    (tmp_path / "firmware").mkdir()
    for pkg in ("host_tools", "host_tools/store", "host_tools/web", "agent", "firmware"):
        (tmp_path / pkg / "__init__.py").write_text('"""doc"""\n')
    (tmp_path / "agent" / "a.py").write_text("def f():\n    from pansketch.agent import b\n")
    (tmp_path / "agent" / "b.py").write_text("from . import a\n")
    (tmp_path / "host_tools" / "store" / "core.py").write_text("def f():\n    import pansketch.host_tools.web.app\n")
    (tmp_path / "host_tools" / "web" / "app.py").write_text("from pansketch.host_tools.store.core import f\n")
    g = graph(tmp_path)
    assert cycles(g) == [["pansketch.agent.a", "pansketch.agent.b"], ["pansketch.host_tools.store.core", "pansketch.host_tools.web.app"]]
    assert violations(g) == ["pansketch.host_tools.store.core -> pansketch.host_tools.web.app: pansketch.host_tools.store may import only "
                             + ", ".join(sorted(SHARED))]



def test_board_fakes_exist_once():
    unix = ROOT / "tests" / "mpunix" / "fakes"
    for name in ("machine.py", "network.py", "ntptime.py", "bluetooth.py"):
        f = unix / name
        assert f.is_symlink() and f.resolve() == (ROOT / "tests" / "mpfakes" / name).resolve(), f
    assert sorted(f.name for f in unix.glob("*.py") if not f.is_symlink()) == ["fakehw.py"]


if __name__ == "__main__":
    g = graph()
    for c in cycles(g):
        print("cycle:", " <-> ".join(c))
    for v in violations(g):
        print("violation:", v)
    edges: dict[tuple[str, str], list[str]] = {}
    for m, deps in g.items():
        for d in deps:
            if role(m) and role(d) and role(m) != role(d):
                edges.setdefault((str(role(m)), str(role(d))), []).append("%s -> %s" % (m, d))
    if "-v" in sys.argv:
        for (a, b), why in sorted(edges.items()):
            print("%s -> %s  (%d: %s)" % (a, b, len(why), why[0]))
