"""Sizes and durations in words (gcwrap.units): what logic and the face both show."""

from __future__ import annotations

import pytest

from gcwrap.units import ago, human_bytes, parse_size, span


def test_sizes_are_read_as_people_write_them() -> None:
    assert parse_size("4096") == 4096
    assert parse_size("8MiB") == 8 << 20
    assert parse_size(" 100 MB ") == 100_000_000
    assert parse_size("1.5k") == 1500
    with pytest.raises(ValueError, match="not a size"):
        parse_size("8 parsecs")


def test_sizes_are_shown_in_binary_units() -> None:
    assert human_bytes(0) == "0 B"
    assert human_bytes(1023) == "1023 B"
    assert human_bytes(1536) == "1.5 KiB"
    assert human_bytes(3 << 30) == "3.0 GiB"
    assert human_bytes(5 << 50) == "5120.0 TiB"  # (no unit past TiB)


def test_durations_and_times_past_in_words() -> None:
    assert span(-3) == "0 s"
    assert span(119) == "119 s"
    assert span(14 * 60) == "14 min"
    assert span(3.25 * 3600) == "3.2 h"
    assert ago(None) == "-"
    assert ago(1000.0, now=1042.0) == "42s ago"
    assert ago(1000.0, now=1000.0 + 14 * 60) == "14m ago"
    assert ago(1000.0, now=1000.0 + 3.5 * 3600) == "3.5h ago"
