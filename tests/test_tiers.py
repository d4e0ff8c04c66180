"""The lists in tests/conftest.py name real files and tests: a renamed one would otherwise drop
out of them silently (a slow test back in the fast tier, a long file handed out last)."""

from __future__ import annotations

import re

import pytest

from tests.conftest import LONGEST_FIRST, ROOT, SLOW


@pytest.mark.parametrize("entry", SLOW + LONGEST_FIRST)
def test_listed_file_and_test_exist(entry):
    path, _, name = entry.partition("::")
    assert (ROOT / path).is_file(), entry
    if name:
        assert re.search(rf"^(async )?def {re.escape(name)}\(", (ROOT / path).read_text(), re.M), entry
