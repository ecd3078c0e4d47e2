"""Shared by tests/test_dashboard.py and the tests that build on it: _band_pixels, _request, _wsgi, get, get_json."""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Optional


def get(url: str, headers: Optional[dict[str, str]] = None) -> tuple[int, str, Any]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=20) as r:
            return r.status, r.read().decode("utf-8"), r.headers
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode("utf-8"), e.headers


def get_json(url: str) -> Any:
    code, body, _h = get(url)
    assert code == 200, body
    return json.loads(body)


def _band_pixels(png: str, rgb: tuple[int, int, int], tol: int = 8) -> int:
    import numpy as np
    from PIL import Image

    px = np.asarray(Image.open(png).convert("RGB"), dtype=np.int16)
    return int((np.abs(px - np.array(rgb, dtype=np.int16)) <= tol).all(axis=2).sum())


# -- read-only, parameterised, escaped -----------------------------------------------------
def _request(url: str, method: str, path: str, headers: Optional[dict[str, str]] = None) -> tuple[int, Any, bytes]:
    u = urllib.parse.urlsplit(url)
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=20)
    try:
        c.request(method, path, body=b"x=1" if method in ("POST", "PUT", "PATCH") else None, headers=headers or {})
        r = c.getresponse()
        return r.status, r.headers, r.read()
    finally:
        c.close()


def _wsgi(app: Any, path: str, qs: str = "", method: str = "GET") -> tuple[str, dict[str, str], str]:
    out: dict[str, Any] = {}

    def start_response(status: str, headers: list[tuple[str, str]]) -> None:
        out["status"], out["headers"] = status, dict(headers)

    body = b"".join(app({"REQUEST_METHOD": method, "PATH_INFO": path, "QUERY_STRING": qs}, start_response))
    return out["status"], out["headers"], body.decode("utf-8")
