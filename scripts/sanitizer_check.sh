#!/usr/bin/env bash
# The native backend under AddressSanitizer and UndefinedBehaviorSanitizer: builds the compiled
# core with both into a scratch copy of the sources, then drives it with the differential
# fuzzer (native against python, every decision compared) and the model-checking fuzzer, after
# the C modules' own tests.
# Any sanitizer report fails the run. CI runs a short one (scripts/test.sh); a long one, e.g.
# ten seeds of 100,000 operations on the hybrid layout, model checks only:
#   KVPOOL_SANITIZER_OPS=100000 KVPOOL_SANITIZER_SEEDS=10 KVPOOL_SANITIZER_LAYOUTS=hybrid \
#   KVPOOL_SANITIZER_MODES=model bash scripts/sanitizer_check.sh
# (KVPOOL_FUZZ_VERIFY_EVERY=N checks the manager's invariants and the bytes every N operations
# instead of after each: most of a long run's time goes to those checks.)
set -euo pipefail
cd "$(dirname "$0")/.."
ops="${KVPOOL_SANITIZER_OPS:-2000}"
work="$(mktemp -d "${TMPDIR:-/tmp}/kvpool-sanitizer-XXXXXX")"
trap 'rm -rf "$work"' EXIT
cp -r setup.py pyproject.toml README.md src "$work/"
find "$work/src" \( -name '*.so' -o -name '_native_stamp.txt' -o -name __pycache__ \) -prune -exec rm -rf {} +
# Every UB check stops the run, but one: mypyc's runtime header negates a tagged int by testing
# it against `(Py_ssize_t)1 << 63` (CPy.h, CPyTagged_Negate), a signed-shift overflow that gcc
# compiles as intended; that check recovers and is suppressed in that header only.
flags="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined"
flags="$flags -fsanitize-recover=shift-base"
printf 'shift-base:CPy.h\n' > "$work/ubsan.supp"
(cd "$work" && CFLAGS="$flags" LDFLAGS="$flags" python3 setup.py -q build_ext --inplace --parallel 2 >"$work/build.log" 2>&1) \
  || { tail -30 "$work/build.log"; exit 1; }
export PYTHONPATH="$work/src" KVPOOL_BACKEND=native
export LD_PRELOAD="$(gcc -print-file-name=libasan.so):$(gcc -print-file-name=libubsan.so)"
# (CPython itself keeps memory to exit by design: leaks are not what this looks for.) Python's
# own allocator hands out memory ASan cannot see, so a read of a freed list's storage would go
# unnoticed: every allocation goes through malloc here.
export PYTHONMALLOC=malloc
export ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:abort_on_error=1"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:suppressions=$work/ubsan.supp"
python3 -c "import kvpool, sys; i = kvpool.backend_info(); print('sanitized backend:', i.describe(), kvpool.__file__); sys.exit(i.name != 'native')"
# The C modules on their own first: their tests drive them against the reference, bad
# arguments and memory errors included.
python3 -m pytest -q -p no:cacheprovider tests/test_chain.py tests/test_ghosts.py | tail -1
seeds="${KVPOOL_SANITIZER_SEEDS:-1}"
first="${KVPOOL_SANITIZER_FIRST_SEED:-1}"
layouts="${KVPOOL_SANITIZER_LAYOUTS:-gpu-host-disk hybrid tight}"
modes="${KVPOOL_SANITIZER_MODES:-backends model}"
# The modes of a seed and layout run side by side (CI has two cores), each into its own log.
for seed in $(seq "$first" $((first + seeds - 1))); do
  for layout in $layouts; do
    pids=()
    for mode in $modes; do
      flag=(); [ "$mode" = backends ] && flag=(--backends)
      python3 -m tests.fuzz.fuzzer --ops "$ops" --seed "$seed" --layout "$layout" "${flag[@]}" \
        --out "$PWD/fuzz-failure-$seed-$layout-$mode.json" >"$work/fuzz-$mode.log" 2>&1 &
      pids+=($!)
    done
    for mode in $modes; do
      if ! wait "${pids[0]}"; then
        tail -40 "$work/fuzz-$mode.log"
        echo "sanitizer check: seed $seed, $layout, $mode FAILED (fuzz-failure-$seed-$layout-$mode.json)"
        exit 1
      fi
      pids=("${pids[@]:1}")
      tail -1 "$work/fuzz-$mode.log"
      echo "sanitizer check: seed $seed, $layout, $mode: $ops operations clean"
    done
  done
done
echo "sanitizer check: clean"
