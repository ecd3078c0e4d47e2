"""pansketch device core: noisy fixed-width sketches for CPython and MicroPython; imports nothing of firmware or host_tools."""

__version__ = "0.1.0"
