"""``cogattn`` on the command line: ``cogattn view PATH`` (the browser view of runs) and ``cogattn dump
CONFIG`` (the batch tool, also ``cogattn-dump``)."""

from __future__ import annotations

import sys

from . import dump, view

COMMANDS = {"view": view.main, "dump": dump.main}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: cogattn {{{','.join(COMMANDS)}}} ...  (cogattn view -h, cogattn dump -h)", file=sys.stderr)
        return 2
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
