"""Paper reproductions (``pansketch repro PAPER --scale tiny|small|paper --out DIR``).

One module per paper; each exposes ``run(scale, out, seed) -> dict`` that
writes PNG plots, a markdown table and a JSON file of every number to
``out`` and returns a summary. docs/REPRODUCTION.md collects the claims.
May import: agent, host_tools.fasthash, host_tools.lab.algorithms.
"""

PAPERS = {
    "dp-linear": "host_tools.lab.repro.dp_linear",
    "intermittent": "host_tools.lab.repro.intermittent",
    "lazy": "host_tools.lab.repro.lazy",
    "panprivate": "host_tools.lab.repro.panprivate",
}
