#!/usr/bin/env bash
# slime's search-r1 example with slimeflow on CPU: the plug-ins in this directory, imported by name as in slime.
#   bash examples/search-r1/run.sh [--flag value ...]     (slimeflow from PATH, else the repository's .venv)
set -euo pipefail
HERE="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd)"
cd "$HERE/../.."
export PYTHONPATH="$HERE${PYTHONPATH:+:$PYTHONPATH}"
SLIMEFLOW="$(command -v slimeflow || echo .venv/bin/slimeflow)"
exec "$SLIMEFLOW" run examples/search-r1/search-r1.yaml "$@"
