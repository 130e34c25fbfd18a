#!/usr/bin/env bash
# Run a command inside the project's virtual environment, creating it on first use.
#   bash scripts/dev.sh python scripts/dump_maps.py
# VENV (default .venv) names the environment and PIP_EXTRA adds pip arguments (e.g. pins).
# BASE_VENV layers VENV on an existing environment: VENV sees BASE_VENV's packages and this checkout,
# and installs only PIP_EXTRA into itself (how .ci/run tests the oldest supported diffusers in seconds).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
absolute() { case "$1" in /*) echo "$1" ;; *) echo "$root/$1" ;; esac; }  # tools that record sys.executable need it
venv="$(absolute "${VENV:-.venv}")"
if [ ! -x "$venv/bin/python" ] || [ ! -f "$venv/.cogattn-ready" ]; then
  # A few lines of progress here; the installer's own output (its warnings included) goes to a log, shown on failure.
  log="$venv.setup.log"
  : > "$log"
  started=$SECONDS
  echo "setting up $venv (the installer's output: $log)" >&2
  step() {
    local what="$1"
    shift
    echo "  $what ..." >&2
    if ! "$@" >>"$log" 2>&1; then
      echo "setting up $venv failed at: $what. The installer's output is in $log; its last lines:" >&2
      tail -n 15 "$log" >&2
      exit 1
    fi
  }
  step "a virtual environment" python3 -m venv "$venv"
  if [ -n "${BASE_VENV:-}" ]; then
    base="$(absolute "$BASE_VENV")"
    site() { "$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }
    # After the layer's own site-packages: the checkout, then the base environment's packages.
    printf '%s\n%s\n' "$root" "$(site "$base")" > "$(site "$venv")/_cogattn_base.pth"
    if [ -n "${PIP_EXTRA:-}" ]; then
      # shellcheck disable=SC2086
      step "$PIP_EXTRA over $base" "$venv/bin/python" -m pip install --no-compile $PIP_EXTRA
    fi
  else
    "$venv/bin/python" -m pip install -q --upgrade pip >>"$log" 2>&1 || true
    # The pinned CPU build first: an unpinned torch would pull several GB of CUDA packages.
    step "torch 2.13.0 (the CPU build)" "$venv/bin/python" -m pip install --no-compile "torch==2.13.0"
    # shellcheck disable=SC2086
    step "cogattn and its test extra" "$venv/bin/python" -m pip install --no-compile -e "$root[test]" ${PIP_EXTRA:-}
  fi
  touch "$venv/.cogattn-ready"
  echo "  ready in $((SECONDS - started)) s" >&2
fi
cd "$root"
PATH="$venv/bin:$PATH" exec "$@"
