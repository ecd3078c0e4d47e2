"""``pansketch audit``: an empirical lower bound on ε for the real device code path.

May import: agent, pansketch.host_tools.hostconfig, pansketch.host_tools.fasthash, pansketch.host_tools.store
(the ledger's ε accounting) and pansketch.host_tools.query (CSV output); runs the device
code itself, never the host's ingest or web.

Modules (docs/PRIVACY.md, "Empirical audit"):

* :mod:`.scenarios` -- neighbouring streams: one event of weight ±clip on a
  target item, placed around persists, restarts, flushes and outbox failures;
  a registry per release mode (a new mode adds its scenarios there);
* :mod:`.device` -- runs the real :class:`pansketch.agent.recorder.Recorder` on a
  scenario and records the intruder's view (every attribute of Recorder,
  Sketch and Rng at each moment, every ``state.bin`` version, every release
  read back from the outbox with cbor2) and the bytes of the CSPRNG;
* :mod:`.model` -- learns from real runs how the view is built from the noise
  draws (exactly: view = exact part + C · draws), verifies it bit for bit on
  fresh real runs, and samples it fast;
* :mod:`.distinguish` -- likelihood-ratio tests on the touched cells, and the pooled
  per-cell tail test (every cell past a threshold, rates measured on all cells of all trials);
* :mod:`.stats` -- Clopper–Pearson and the ε lower bound of Jagielski et al. 2020;
* :mod:`.report` and :mod:`.cli` -- the table, JSON lines and the subcommand.
"""
