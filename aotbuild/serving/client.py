"""A minimal HTTP client for the server (standard library only): what `bench --serve`, the load
bench and the tests send."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any


def request(url: str, body: dict[str, Any] | None = None, timeout: float = 600) -> tuple[int, dict[str, str], bytes]:
    """(status, headers with lower-case names, body) of a GET (no body) or JSON POST; HTTP errors
    are returned, not raised."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as response:
            return response.status, {k.lower(): v for k, v in response.headers.items()}, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, {k.lower(): v for k, v in exc.headers.items()}, exc.read()
