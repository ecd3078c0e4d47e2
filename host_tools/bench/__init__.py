"""Benchmarks (``python -m pansketch.host_tools.bench.<name>``, figures to bench-results/).

May import anything of the project (and tests' launchers); nothing imports bench.
"""
