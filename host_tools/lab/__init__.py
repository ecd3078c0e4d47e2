"""The lab: library versions of the papers' algorithms (algorithms) and their reproductions (repro, ``pansketch repro``).

May import: agent, pansketch.host_tools.fasthash and each other (repro -> algorithms).
Nothing imports the lab except the entry point cli and the benchmarks.
"""
