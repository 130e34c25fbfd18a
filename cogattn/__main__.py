"""``cogattn`` on the command line: ``cogattn view PATH`` (the browser view of runs) and ``cogattn dump
CONFIG`` (the batch tool, also ``cogattn-dump``)."""

from __future__ import annotations

import importlib
import sys

# command → the module whose `main` runs it, imported for that command alone (the view needs no model code)
COMMANDS = {"view": "cogattn.view.server", "dump": "cogattn.dump.cli"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: cogattn {{{','.join(COMMANDS)}}} ...  (cogattn view -h, cogattn dump -h)", file=sys.stderr)
        return 2
    return importlib.import_module(COMMANDS[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
