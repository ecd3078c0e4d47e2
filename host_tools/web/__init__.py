"""Web: read-only web UI, JSON API and /metrics over the release store (``pansketch serve``).

:class:`host_tools.web.app.Dashboard` is a plain WSGI application (GET and
HEAD only, every store read parameterised and on a read-only connection);
``pansketch serve`` (serve) runs it under waitress; metrics holds the
Prometheus exporters. See docs/HOST.md ("Dashboard").
May import: agent, host_tools.query, host_tools.store, host_tools.hostconfig.
Nothing imports web except the entry points (cli, demo).
"""
