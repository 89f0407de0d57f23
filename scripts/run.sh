#!/usr/bin/env bash
# Installs kvpool and runs its main job: a replay of the embedded synthetic chat workload.
# README's first command and .ci/run both call this script; extra arguments go to `kvpool replay`.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install --quiet --disable-pip-version-check -e '.[replay]'
kvpool replay --no-progress "$@"
