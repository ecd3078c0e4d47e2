"""Logging of the host services (``pansketch aggregate``, ``pansketch serve``): one stderr handler on the "pansketch" logger."""

from __future__ import annotations

import logging
import sys

from pansketch.host_tools.output import textsafe


def setup_logging(verbose: bool = False, quiet: bool = False) -> None:
    """Log to stderr at DEBUG (verbose), WARNING (quiet) or INFO; idempotent."""
    root = logging.getLogger("pansketch")
    if not root.handlers:
        h = logging.StreamHandler(sys.stderr)
        # SafeFormatter: messages quote device strings (topics, reasons); escaped, they cannot forge lines
        h.setFormatter(textsafe.SafeFormatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        root.addHandler(h)
    root.setLevel(logging.DEBUG if verbose else logging.WARNING if quiet else logging.INFO)
