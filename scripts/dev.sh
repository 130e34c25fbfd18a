#!/usr/bin/env bash
# Run a command inside the project's virtual environment, creating it on first use.
#   bash scripts/dev.sh python scripts/dump_maps.py
# VENV (default .venv) and PIP_EXTRA (extra pip arguments, e.g. pins) choose the environment.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${VENV:-.venv}"
case "$venv" in /*) ;; *) venv="$root/$venv" ;; esac  # absolute: tools that record sys.executable need it
if [ ! -x "$venv/bin/python" ] || [ ! -f "$venv/.cogattn-ready" ]; then
  echo "setting up $venv ..." >&2
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip 2>/dev/null || true
  # The pinned CPU build first: an unpinned torch would pull several GB of CUDA packages.
  "$venv/bin/python" -m pip install -q "torch==2.13.0"
  # shellcheck disable=SC2086
  "$venv/bin/python" -m pip install -q -e "$root[test]" ${PIP_EXTRA:-}
  touch "$venv/.cogattn-ready"
fi
cd "$root"
PATH="$venv/bin:$PATH" exec "$@"
