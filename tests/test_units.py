from fractions import Fraction

import numpy as np
import pytest

from labkit.units import GiB, MiB, fmt_bytes, parse_bytes


@pytest.mark.parametrize("text, expected", [("64 MiB", 64 * MiB), ("2GiB", 2 * GiB), ("1.5 GB", 1_500_000_000),
                                            ("512", 512), (1024, 1024), ("3 kib", 3072), ("2 gb", 2_000_000_000),
                                            (np.int64(7), 7), (2e9, 2_000_000_000), ("1.5 KiB", 1536),
                                            ("1.1 KB", 1100), ("0.3 KB", 300), ("1e3 B", 1000)])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad, error", [("lots", ValueError), ("-1 GiB", ValueError), (0, ValueError),
                                        (None, TypeError), (True, TypeError), ("2 parsecs", ValueError),
                                        (1.5, ValueError), (0.5, ValueError), (float("nan"), ValueError),
                                        (float("inf"), ValueError), ("1e400 GB", ValueError), ("0.5", ValueError),
                                        ("2 Gb", ValueError), ("8 Mib", ValueError), (Fraction(1, 2), ValueError),
                                        ("2.5 B", ValueError), ("0.0001 KB", ValueError)])
def test_parse_bytes_bad_input_names_argument(bad, error):
    with pytest.raises(error, match="budget"):
        parse_bytes(bad, "budget")


def test_bits_are_refused_with_the_byte_units_to_write():
    with pytest.raises(ValueError, match=r"size '2 Gb' is in bits \('Gb'\); .* write 'GB' .* or 'GiB'"):
        parse_bytes("2 Gb")
    with pytest.raises(ValueError, match=r"whole number of bytes, got 1.5"):
        parse_bytes(1.5)


def test_fmt_bytes():
    assert fmt_bytes(1536) == "1.50 KiB"
    assert fmt_bytes(3 * GiB) == "3.00 GiB"
    assert fmt_bytes(12) == "12 B"
    assert fmt_bytes(-2 * MiB) == "-2.00 MiB"


def test_a_string_that_is_not_a_whole_number_of_bytes_is_refused_not_truncated():
    """"2.5 B" was read as 2 bytes; "1.1 KB" is 1100 bytes exactly (1.1 * 1000 in floats is 1100.0000000000002)."""
    with pytest.raises(ValueError, match=r"budget must be a whole number of bytes, got '2.5 B'"):
        parse_bytes("2.5 B", "budget")
    assert parse_bytes("1.1 KB") == 1100 and parse_bytes("0.5 KiB") == 512


def test_a_string_in_a_larger_unit_is_rounded_down_to_whole_bytes():
    """"21.6 GiB" (labkit.device.LIMIT as fmt_bytes prints it) is 23192823398.4 bytes: its whole bytes, as
    LIMIT itself; a count of bytes or a number must be whole."""
    import labkit as lk
    assert parse_bytes("21.6 GiB") == lk.LIMIT == 23192823398 and parse_bytes("1.0001 KB") == 1000
    with lk.budget("21.6 GiB") as mem:
        assert mem.budget == lk.LIMIT
    with pytest.raises(ValueError, match="whole number of bytes"):
        parse_bytes(lk.CARD * (1 - lk.HEADROOM))
