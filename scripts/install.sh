#!/usr/bin/env bash
# Create .venv (if missing) and install p2psync with its test extras into it.
# torch: where the 2.13.0 CPU wheel lies on this machine (pip's find-links), it is installed
# first, so no multi-GB CUDA build is pulled; elsewhere torch>=2.1 resolves from the index.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip)
if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
    probe=$(mktemp -d)
    # is the CPU wheel available locally? (--no-index: never downloads; --no-deps: wheel only)
    if "${PIP[@]}" download -q --no-index --no-deps torch==2.13.0 -d "$probe" >/dev/null 2>&1; then
        "${PIP[@]}" install -q torch==2.13.0 2>&1 | grep -v "^WARNING: Location" || true
    else
        echo "install.sh: no local torch 2.13.0 CPU wheel; torch>=2.1 comes from the index" >&2
    fi
    rm -rf "$probe"
fi
"${PIP[@]}" install -q -e '.[test]' 2>&1 | grep -v "^WARNING: Location" || true
"$VENV/bin/python" -c "import p2psync, torch; print(f'install.sh: p2psync {p2psync.__version__}, torch {torch.__version__} in $VENV')" >&2
# compile the numba kernels into their on-disk cache now (about 10 s), not in every node's first
# exchange (p2psync/cli/precompile.py)
"$VENV/bin/python" -m p2psync.cli.precompile || echo "install.sh: precompiling the numba kernels failed; each node compiles them on first use" >&2
