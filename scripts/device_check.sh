#!/usr/bin/env bash
# The one prepared GPU run (issue 17): kernel tests, backend parity, CUDA-graph decode,
# kernel bandwidth and `dsakv bench --quick`, in one summary + OUT/device_check.json.
# Runs on the device image's own python3 (no pip, no network): dsakv comes from src/ and
# any missing pure-Python dependency from the wheels `make wheelhouse` put in .whl/.
#   scripts/device_check.sh [--dry-run] [--out DIR] [--no-bench]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ]; then PY=.venv/bin/python; fi
if compgen -G ".whl/*.whl" >/dev/null; then
    site=$(mktemp -d)
    for w in .whl/*.whl; do "$PY" -m zipfile -e "$w" "$site"; done
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" -m dsakv.cli device-check "$@"
