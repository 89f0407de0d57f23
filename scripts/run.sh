#!/usr/bin/env bash
# Installs kvpool and runs its main job. README's first command and .ci/run both call this script.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install --quiet --disable-pip-version-check -e .
kvpool info "$@"
