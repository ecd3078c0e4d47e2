"""The dashboard's request errors (shared by app and kinds)."""


class BadRequest(Exception):
    """A request the dashboard refuses (HTTP 400, the message shown as is)."""
