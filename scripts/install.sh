#!/usr/bin/env bash
# Create .venv (if missing) and install p2psync with its test extras into it.
# torch: the 2.13.0 CPU wheel is installed first when it is available locally (pip's
# find-links), so no multi-GB CUDA build is pulled; otherwise torch>=2.1 resolves normally.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
    "$VENV/bin/python" -m pip install -q --no-index torch==2.13.0 2>/dev/null \
        || echo "install.sh: local torch 2.13.0 CPU wheel not found; torch>=2.1 comes from the index" >&2
fi
"$VENV/bin/python" -m pip install -q -e '.[test]'
echo "install.sh: p2psync installed in $VENV" >&2
