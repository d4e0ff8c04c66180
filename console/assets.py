"""Where the console's Jinja templates and static files are, from a checkout or an installed wheel.

The repository keeps the templates at top level (templates/admin/*.html); the wheel ships them
inside the package as console/templates (pyproject.toml maps console.templates to templates/).
Static files live in console/static in both.
"""

from __future__ import annotations

from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent


def templates_dir() -> Path:
    """console/templates in an installed distribution, else the checkout's templates/."""
    packaged = PACKAGE_DIR / "templates"
    return packaged if packaged.is_dir() else PACKAGE_DIR.parent / "templates"


def static_dir() -> Path:
    return PACKAGE_DIR / "static"
