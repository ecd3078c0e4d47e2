"""Benchmarks (``python -m pansketch.host_tools.bench.<name>``, figures to bench-results/).

localfleet: agents, hosts and the aggregator thread on this machine (the end-to-end tests use it too).
May import anything of the project; of the tests only the MicroPython WebAssembly VM (core) and the
memory-residue scenario (memresidue), as tests/test_layering.py lists. Nothing of the product imports bench.
"""
