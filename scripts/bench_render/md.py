"""The results files and markdown tables the BENCHMARKS.md sections share."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any


def load(d: Path, name: str) -> dict[str, Any] | None:
    """`d/name` as JSON; None when it is missing or not JSON (the section says "not measured")."""
    p = d / name
    if not p.is_file():
        return None
    try:
        return json.loads(p.read_text())
    except ValueError:
        return None


def table(head: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return out
