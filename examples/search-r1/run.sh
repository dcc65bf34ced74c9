#!/usr/bin/env bash
# slime's search-r1 example with slimeflow on CPU: the plug-ins in this directory, imported by name as in slime.
set -euo pipefail
HERE="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd)"
cd "$HERE/../.."
export PYTHONPATH="$HERE${PYTHONPATH:+:$PYTHONPATH}"
exec slimeflow run examples/search-r1/search-r1.yaml "$@"
