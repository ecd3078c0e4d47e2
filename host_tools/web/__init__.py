"""Web: read-only web UI, JSON API and /metrics over the release store (``pansketch serve``).

:class:`pansketch.host_tools.web.app.Dashboard` is a plain WSGI application (GET and
HEAD only, every store read parameterised and on a read-only connection);
``pansketch serve`` (serve) runs it under waitress; kinds holds the pages of
the query kinds; /metrics comes from pansketch.host_tools.metrics. See docs/HOST.md
("Dashboard"). May import: agent, pansketch.host_tools.query, pansketch.host_tools.store,
pansketch.host_tools.metrics, pansketch.host_tools.hostconfig, pansketch.host_tools.logsetup.
Nothing imports web except the entry points (cli, demo).
"""
