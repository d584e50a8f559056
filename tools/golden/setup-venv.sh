#!/usr/bin/env bash
# Creates (or brings up to date) the venv of the golden-logits tool, OUTSIDE the repository.
# Idempotent: re-running only installs what is missing. Not used by CI.
#   tools/golden/setup-venv.sh            # venv at ~/.cache/pdserve/golden-venv
#   GOLDEN_VENV=/path tools/golden/setup-venv.sh
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="${GOLDEN_VENV:-$HOME/.cache/pdserve/golden-venv}"
PYTHON="${PYTHON:-python3}"
TORCH_PIN="$(grep -E '^torch==' "$HERE/requirements.txt")"

if [ ! -x "$VENV/bin/python" ]; then
    mkdir -p "$(dirname "$VENV")"
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
fi

# torch first: the CPU-only wheel is much smaller; fall back to PyPI (CUDA wheel, works on CPU).
if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
    if ! "$VENV/bin/pip" install --retries 1 --timeout 30 "$TORCH_PIN" \
            --index-url https://download.pytorch.org/whl/cpu; then
        echo "setup-venv: CPU wheel index unavailable, installing $TORCH_PIN from PyPI" >&2
        "$VENV/bin/pip" install "$TORCH_PIN"
    fi
fi

"$VENV/bin/pip" install --quiet -r "$HERE/requirements.txt"

"$VENV/bin/python" - <<'PY'
import numpy, safetensors, torch, transformers
print(f"golden venv ready: torch {torch.__version__}, transformers {transformers.__version__}, "
      f"safetensors {safetensors.__version__}, numpy {numpy.__version__}")
PY
echo "run: $VENV/bin/python $HERE/golden.py selftest"
