"""What the benchmarks share: each prints its table, with the command that made it, and writes it to a file."""

from __future__ import annotations

import os
import sys

__all__ = ["write_table"]


def write_table(lines: list[str], out: str) -> None:
    """Print ``lines`` and the command line that made them, and write both to ``out``."""
    table = "\n".join([*lines, "", f"Command: `python {' '.join(sys.argv)}`"])
    print("\n" + table)
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        f.write(table + "\n")
    print(f"\nwritten to {out}")
