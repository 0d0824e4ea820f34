"""Quantities as people read them: the unit is the one the rounded figure belongs to."""

from __future__ import annotations

import pytest

from spindle_cli.cli.views import fmt_count
from spindle_cli.units import fmt_bytes


@pytest.mark.parametrize(("n", "text"), [
    (384, "384 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (1.5 * 2**20, "1.5 MiB"),
    (1023.94 * 2**20, "1023.9 MiB"),
    # just below a unit, where the unit below would print 1024.0 (a review: 1024.0 MiB)
    (2**30 - 1, "1.0 GiB"), (1023.96 * 2**20, "1.0 GiB"), (1023.96 * 2**10, "1.0 MiB"),
    (-(2**30 - 1), "-1.0 GiB"), (5000 * 2**40, "5000.0 TiB"),
])
def test_fmt_bytes_names_the_unit_of_the_rounded_figure(n, text):
    assert fmt_bytes(n) == text


@pytest.mark.parametrize(("n", "text"), [
    (512, "512"), (999, "999"), (1000, "1.0K"), (999_940, "999.9K"),
    (999_950, "1.0M"), (50e6, "50.0M"), (1e8, "0.10B"), (1.2e9, "1.20B"),
])
def test_fmt_count_names_the_unit_of_the_rounded_figure(n, text):
    assert fmt_count(n) == text
