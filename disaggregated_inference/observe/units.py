"""How every view writes a figure ("-" where there is none): the dashboard and ``disagg top`` alike."""
from __future__ import annotations


def seconds(x) -> str:
    if x is None:
        return "-"
    return f"{x * 1000:.0f} ms" if x < 1 else f"{x:.2f} s"


def count(x) -> str:
    """A rate or a count, no unit: 1,234."""
    return "-" if x is None else f"{x:,.0f}"


def tokens_per_second(x) -> str:
    return "-" if x is None else f"{x:,.0f} tok/s"


def share(x) -> str:
    return "-" if x is None else f"{x * 100:.0f}%"


def gbps(x) -> str:
    return "-" if x is None else f"{x:.2f}"
