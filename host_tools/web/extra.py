"""Whether the web extra (``pip install 'pansketch[web]'``) is installed, asked before any work starts.

``pansketch serve`` and ``pansketch demo --serve`` import the dashboard's libraries only when they
serve; without this check the demo ran its whole fleet first and only then said jinja2 was missing.
"""

from __future__ import annotations

import importlib.util
from typing import Optional

# import name -> distribution, as the web extra of pyproject.toml lists them
WEB_MODULES = {"waitress": "waitress", "jinja2": "jinja2", "prometheus_client": "prometheus-client"}


def missing_web() -> Optional[str]:
    """One line naming what is missing and how to install it, or None when everything is there."""
    gone = [dist for mod, dist in WEB_MODULES.items() if importlib.util.find_spec(mod) is None]
    if not gone:
        return None
    return "needs the web extra, which is not installed (missing: %s): pip install 'pansketch[web]'" % ", ".join(gone)
