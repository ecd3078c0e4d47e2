"""Web: read-only web UI, JSON API and /metrics over the release store (``pansketch serve``).

:class:`host_tools.web.app.Dashboard` is a plain WSGI application (GET and
HEAD only, every store read parameterised and on a read-only connection);
``pansketch serve`` (serve) runs it under waitress; kinds holds the pages of
the query kinds; /metrics comes from host_tools.metrics. See docs/HOST.md
("Dashboard"). May import: agent, host_tools.query, host_tools.store,
host_tools.metrics, host_tools.hostconfig, host_tools.logsetup.
Nothing imports web except the entry points (cli, demo).
"""
