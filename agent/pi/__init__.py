"""The Pi daemon (``pansketch-agent``): CPython only, never frozen onto a board.

Config files, input sources, the MQTT publisher, the numpy batch path and the
process plumbing around the portable core in ``agent/``. May import: the core
(``agent.*``), the standard library, numpy and paho; never host_tools or firmware.
"""
