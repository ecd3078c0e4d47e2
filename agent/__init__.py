"""pansketch device core: noisy fixed-width sketches for CPython and MicroPython."""

__version__ = "0.1.0"
