"""Read-only web UI, JSON API and /metrics over the release store (``pansketch serve``).

:class:`host_tools.web.app.Dashboard` is a plain WSGI application (GET and
HEAD only, every store read parameterised and on a read-only connection);
``pansketch serve`` runs it under waitress. See docs/HOST.md ("Dashboard").
"""

from host_tools.web.app import Dashboard  # noqa: F401
