"""Plain-text tables for the plan, the cost model, the demo and the benchmarks."""

from __future__ import annotations


def format_table(rows: list[list], align: str = "right") -> str:
    """`rows[0]` is the header: columns padded to their widest cell (`align` "right" or
    "left"), a rule of dashes under the header, cells joined by two spaces."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    pad = str.rjust if align == "right" else str.ljust
    lines = ["  ".join(pad(c, w) for c, w in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
