"""Numbers on the command line and in tables: byte sizes, times, rates, and the size sweep.

``parse_size("64K") == 65536`` (K, M, G, T are powers of 1024), ``format_size(65536) == "64K"``,
``byte_sizes(8, 64 << 20, 8)`` is nccl-tests' ``-b 8 -e 64M -f 8``, ending at 64M.
"""
from __future__ import annotations

import re

__all__ = ["parse_size", "parse_time", "parse_rate", "format_size", "byte_sizes"]

_BINARY = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text) -> int:
    """Bytes from ``"64M"``, ``"1KiB"``, ``"8"``, ``"256MB"`` (K, M, G are powers of 1024)."""
    if isinstance(text, int) or (hasattr(text, "dtype") and text.dtype.kind in "iu"):
        return int(text)
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([kKmMgGtT]?)(?:i?[bB])?\s*", str(text))
    if not m:
        raise ValueError(f"cannot read a byte size from {text!r}; expected e.g. 8, 64K, 256M, "
                         f"1G")
    value = float(m.group(1)) * _BINARY[m.group(2).lower()]
    if value != int(value):
        raise ValueError(f"{text!r} is not a whole number of bytes")
    return int(value)


def parse_time(text) -> float:
    """Seconds from ``"5us"``, ``"1.5ms"``, ``"2e-6"`` (a bare number is seconds)."""
    m = re.fullmatch(r"\s*([\d.]+(?:[eE][-+]?\d+)?)\s*(s|ms|us|µs|ns)?\s*", str(text))
    if not m:
        raise ValueError(f"cannot read a time from {text!r}; expected e.g. 5us, 1.5ms, 2e-6")
    scale = {None: 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}[m.group(2)]
    return float(m.group(1)) * scale


def parse_rate(text) -> float:
    """Bytes per second from ``"25GB/s"`` (decimal), ``"10GiB/s"`` (binary), ``"100Gb/s"``
    (bits)."""
    m = re.fullmatch(r"\s*([\d.]+(?:[eE][-+]?\d+)?)\s*([kKmMgGtT]?)(i?)([bB])(?:/s|ps)\s*",
                     str(text))
    if not m:
        raise ValueError(f"cannot read a bandwidth from {text!r}; expected e.g. 25GB/s, "
                         f"100Gb/s, 10GiB/s")
    prefix = m.group(2).lower()
    scale = _BINARY[prefix] if m.group(3) else 1000 ** "_kmgt".index(prefix or "_")
    bits = m.group(4) == "b"
    return float(m.group(1)) * scale / (8 if bits else 1)


def format_size(nbytes: int) -> str:
    """``65536 -> "64K"``: the largest binary unit that divides ``nbytes``."""
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return str(nbytes)


def byte_sizes(begin: int, end: int, factor: float) -> list[int]:
    """``begin, begin*factor, ...`` below ``end``, then ``end`` itself (nccl-tests ``-b -e
    -f``): a sweep always reaches the size it was asked to end at."""
    if begin < 1 or end < begin:
        raise ValueError(f"need 1 <= -b ({begin}) <= -e ({end})")
    if factor <= 1:
        raise ValueError(f"the step factor -f must be > 1, got {factor}")
    out, size = [], begin
    while size < end:
        out.append(int(size))
        size = max(int(size * factor), int(size) + 1)
    out.append(int(end))
    return out
