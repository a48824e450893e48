#!/usr/bin/env bash
# The one prepared GPU run: `dsakv device-check`, eleven stages in one command under 9
# minutes, each in its own process under its own deadline; OUT/device_check.json is
# rewritten and one line printed after every stage (README: "the device check").
# Runs on the device image's own python3 (no pip, no network): dsakv comes from src/, the
# models from .device-models/ (`make device-models` here, then carry it), and what the image
# lacks from the wheels `make wheelhouse` put in .whl/ (those this python can import).
#   scripts/device_check.sh [--dry-run] [--out DIR] [--stages a,b] [--deadline STAGE=S] [--bench]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ]; then PY=.venv/bin/python; fi
if compgen -G ".whl/*.whl" >/dev/null; then
    site=$(mktemp -d)
    "$PY" scripts/unpack_wheels.py "$site" .whl/*.whl
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
exec "$PY" -u -m dsakv.cli device-check "$@"
