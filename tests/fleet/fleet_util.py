"""Shared by the fleet test modules (no tests here): a logged-in console client and the
fleet page's JSON snapshot."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

import httpx


@contextmanager
def logged_in_console(fleet) -> Iterator[httpx.Client]:
    """An httpx client logged in to the fleet's console with its admin token."""
    c = httpx.Client(base_url=fleet.url, timeout=60, follow_redirects=True)
    nonce = re.search(r'name="_csrf_token" value="([^"]+)"', c.get("/admin/login").text).group(1)
    r = c.post("/admin/login", data={"token": fleet.admin_token, "_csrf_token": nonce})
    assert r.status_code == 200 and "Fleet" in r.text
    try:
        yield c
    finally:
        c.close()


def state(console: httpx.Client) -> dict:
    r = console.get("/admin/fleet.json")
    assert r.status_code == 200
    return r.json()
