// Run one MicroPython job in the official WebAssembly port (npm
// @micropython/micropython-webassembly-pyscript) under node.
//
// usage: node run.mjs JOB.json        (writes JOB.json.result)
// JOB: {steps: [code, ...], heapsize, src: [[hostDir, guestDir], ...], flash: hostDir|null}
//
// The port's filesystem is in-memory (MEMFS). Source trees are copied in
// read-only by convention; the "flash" directory is copied in before the
// run and mirrored back afterwards, also when the Python code raised, so
// an exception thrown at any point behaves like a power cut at that point:
// whatever the code had written to /flash survives, nothing else does.
//
// The port grows its GC heap on demand (split heap) and collects only
// between top-level calls, so the job is a list of steps and the live heap
// after each step is reported.
import { loadMicroPython } from "@micropython/micropython-webassembly-pyscript";
import fs from "node:fs";
import path from "node:path";

const jobPath = process.argv[2];
const job = JSON.parse(fs.readFileSync(jobPath, "utf8"));
const out = [];
const err = [];
let sink = out;
const mp = await loadMicroPython({
  heapsize: job.heapsize || 131072,
  pystack: job.pystack || 4096,
  linebuffer: false,
  stdout: (s) => sink.push(typeof s === "string" ? s : Buffer.from(s).toString("utf8")),
  stderr: (s) => err.push(typeof s === "string" ? s : Buffer.from(s).toString("utf8")),
});
const FS = mp.FS;

function mkdirp(p) {
  let cur = "";
  for (const part of p.split("/").filter(Boolean)) {
    cur += "/" + part;
    try { FS.mkdir(cur); } catch (e) { /* exists */ }
  }
}

function copyIn(host, guest) {
  mkdirp(guest);
  for (const name of fs.readdirSync(host)) {
    if (name === "node_modules" || name === "__pycache__" || name.startsWith(".")) continue;
    const h = path.join(host, name);
    const g = guest + "/" + name;
    const st = fs.statSync(h);
    if (st.isDirectory()) copyIn(h, g);
    else FS.writeFile(g, fs.readFileSync(h));
  }
}

function copyOut(guest, host) {
  fs.mkdirSync(host, { recursive: true });
  const seen = new Set();
  for (const name of FS.readdir(guest)) {
    if (name === "." || name === "..") continue;
    seen.add(name);
    const g = guest + "/" + name;
    const h = path.join(host, name);
    if (FS.isDir(FS.stat(g).mode)) copyOut(g, h);
    else {
      if (fs.existsSync(h) && fs.statSync(h).isDirectory()) fs.rmSync(h, { recursive: true });
      fs.writeFileSync(h, FS.readFile(g));
    }
  }
  for (const name of fs.readdirSync(host)) {
    if (!seen.has(name)) fs.rmSync(path.join(host, name), { recursive: true, force: true });
  }
}

for (const [host, guest] of job.src || []) copyIn(host, guest);
if (job.flash) {
  fs.mkdirSync(job.flash, { recursive: true });
  copyIn(job.flash, "/flash");
}

// The port only collects garbage between top-level runPython calls (it
// cannot scan the wasm stack), so a job is a list of steps and the live heap
// is read after each one, following that top-level collection.
function heapNow() {
  const saved = sink;
  sink = [];
  mp.runPython("import micropython\nmicropython.mem_info()");
  const m = /GC: total: (\d+), used: (\d+)/.exec(sink.join(""));
  sink = saved;
  return m ? { total: Number(m[1]), used: Number(m[2]) } : { total: null, used: null };
}

let ok = true;
let error = null;
const live = [];
const t0 = process.hrtime.bigint();
const steps = job.steps || [job.code];
for (const step of steps) {
  try {
    mp.runPython(step);
  } catch (e) {
    ok = false;
    error = String(e && e.message ? e.message : e);
    break;
  }
  live.push(heapNow());
}
const wallMs = Number(process.hrtime.bigint() - t0) / 1e6;
if (job.flash) copyOut("/flash", job.flash);
fs.writeFileSync(
  jobPath + ".result",
  JSON.stringify({ ok, error, stdout: out.join(""), stderr: err.join(""), live, wall_ms: wallMs }),
);
