"""``cogattn`` on the command line: ``cogattn view PATH`` (the browser view of runs) and ``cogattn dump
CONFIG`` (the batch tool, also ``cogattn-dump``)."""

from __future__ import annotations

import importlib
import sys

# command → the module whose `main` runs it, imported for that command alone (the view needs no model code)
COMMANDS = {"view": "cogattn.view.server", "dump": "cogattn.dump.cli"}


USAGE = """usage: cogattn {view,dump} ...

  cogattn view PATH      the browser view of the runs under PATH (cogattn view -h)
  cogattn dump CONFIG    the batch tool: a config's prompts into run folders (cogattn dump -h; also cogattn-dump)
  python -m cogattn.selftest   check every method and family on this machine"""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["-h"], ["--help"]):
        print(USAGE)
        return 0
    if not argv or argv[0] not in COMMANDS:
        print(USAGE, file=sys.stderr)
        return 2
    return importlib.import_module(COMMANDS[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
