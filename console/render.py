"""One way every console page renders: the full page, or for HTMX just its fragment, with
the session's CSRF token, name and role (the templates disable what a viewer cannot do)."""

from __future__ import annotations

import time
from typing import Any

from litestar import Request
from litestar.response import Template
from litestar.template.base import csrf_token as _csrf_token

NO_STORE = {"Cache-Control": "no-store", "Vary": "HX-Request"}


def is_htmx(request: Request) -> bool:
    return request.headers.get("hx-request") == "true"


def csrf_token(request: Request) -> str:
    """This request's CSRF token (Litestar's CSRF middleware sets it), for the forms and hx-headers."""
    return _csrf_token({"request": request})


def render(request: Request, page: str, ctx: dict[str, Any], status: int = 200) -> Template:
    """`templates/admin/{page}.html`, or `_{page}_fragment.html` for an HTMX request."""
    s = request.state.admin_session
    name = f"admin/_{page}_fragment.html" if is_htmx(request) else f"admin/{page}.html"
    ctx = {**ctx, "csrf": csrf_token(request), "who": s.who, "role": s.role, "can_write": s.can_write, "page": page,
           "fleet": request.app.state.get("is_fleet", False), "clock": time.strftime("%H:%M:%S")}
    return Template(name, context=ctx, status_code=status, headers=NO_STORE)
