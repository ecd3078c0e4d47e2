"""pansketch device core: noisy fixed-width sketches for CPython and MicroPython.

Every module directly in this folder is the portable core, frozen onto boards
(firmware/manifest.py freezes the folder): MicroPython subset only, imports
nothing of firmware or host_tools. ``pansketch.agent.pi`` is the CPython-only Pi daemon
built on it.
"""

__version__ = "0.1.0"
