#!/usr/bin/env bash
# mypy over the host code under its import name, pansketch.host_tools (it follows the imports into
# pansketch.agent): mypy does not read the editable install's import hook, so it reads a pansketch/ folder
# of symlinks to this checkout's agent/, firmware/ and host_tools/, made in a temporary directory.
#
#   tests/mypy.sh [PYTHON]        # default .venv/bin/python; configuration: pyproject.toml [tool.mypy]
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
py=${1:-$repo/.venv/bin/python}
tree=$(mktemp -d)
trap 'rm -rf "$tree"' EXIT
mkdir "$tree/pansketch"
for d in agent firmware host_tools; do ln -s "$repo/$d" "$tree/pansketch/$d"; done
cd "$repo"
MYPYPATH="$tree" "$py" -m mypy --config-file "$repo/pyproject.toml" --cache-dir "$repo/.mypy_cache" -p pansketch.host_tools
