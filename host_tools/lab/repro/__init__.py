"""Paper reproductions (``pansketch repro PAPER --scale tiny|small|paper --out DIR``).

One module per paper; each exposes ``run(scale, out, seed) -> dict`` that
writes PNG plots, a markdown table and a JSON file of every number to
``out`` and returns a summary. docs/REPRODUCTION.md collects the claims.
May import: agent, pansketch.host_tools.fasthash, pansketch.host_tools.lab.algorithms.
"""

PAPERS = {
    "dp-linear": "pansketch.host_tools.lab.repro.dp_linear",
    "intermittent": "pansketch.host_tools.lab.repro.intermittent",
    "lazy": "pansketch.host_tools.lab.repro.lazy",
    "panprivate": "pansketch.host_tools.lab.repro.panprivate",
}
