#!/usr/bin/env bash
# One step of GPU evidence per device call (each under 10 minutes):
#   bash bench/device_session.sh tests [PYTEST_K]   gpu-marked tests (all, or those -k selects)
#   bash bench/device_session.sh suite SUITE        a suite of run_benchmarks.SUITES
#        (ROUNDS=n: interleaved rounds; ROUND=rN: this call's file is results-SUITE-rN.json;
#        JOBS=n: n cases side by side, for suites that measure loss)
#   bash bench/device_session.sh profile SUITE      a suite whose rows set profiling.*: each
#        run's trace summary (profile/rank0-summary.txt), tarred
#   bash bench/device_session.sh commit-ab          SUITE at the sent tree (B) and at commit
#        A_REV (A: its src/ with this bench/), in turn, RUNS (default "b1 a1 b2")
# Run from the project root on the GPU machine with megatron-core and TE importable; results go
# to $OUT (default ./device-out). Every number comes from a real run_recipe.py training run.
set -euo pipefail
OUT=${OUT:-device-out}
WORK=${WORK:-/tmp/offload-runner}
mkdir -p "$OUT" "$WORK"
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
# The commit the results record: give it (the device's copy of .git may lag the working tree it
# was sent, so its HEAD is not trusted), e.g. OFFLOAD_RUNNER_COMMIT=$(git rev-parse --short HEAD) here.
: "${OFFLOAD_RUNNER_COMMIT:?set OFFLOAD_RUNNER_COMMIT to the commit whose working tree was sent}"
export OFFLOAD_RUNNER_COMMIT
suite() {  # suite SUITE WORK_DIR OUT_FILE
  python bench/run_benchmarks.py run --suite "$1" --iters "${ITERS:-6}" --rounds "${ROUNDS:-1}" \
    --jobs "${JOBS:-1}" --time-limit "${TIME_LIMIT:-540}" --work-dir "$2" --out "$3"
}

case "$1" in
  tests)
    timeout "${TEST_TIMEOUT:-560}" python -m pytest -q -m gpu ${2:+-k "$2"} tests/ 2>&1 \
      | tee "$OUT/pytest-gpu.txt" | tail -15 || true ;;
  suite)
    suite "$2" "$WORK/$2" "$OUT/results-$2${ROUND:+-$ROUND}.json" ;;
  profile)
    suite "$2" "$WORK/$2" "$OUT/results-$2.json"
    find "$WORK/$2" -name rank0-summary.txt | while read -r summary; do
      cp "$summary" "$WORK/prof-$(basename "$(dirname "$(dirname "$summary")")").txt"
    done
    tar czf "$OUT/profiles-$2.tgz" -C "$WORK" $(cd "$WORK" && ls prof-*.txt) ;;
  commit-ab)
    : "${A_REV:?set A_REV}" "${SUITE:?set SUITE}"
    A=/tmp/ab-a; rm -rf "$A"; mkdir -p "$A"; git archive "$A_REV" | tar -x -C "$A"; cp -r bench "$A/"
    for run in ${RUNS:-b1 a1 b2}; do
      tree=$PWD rev=$OFFLOAD_RUNNER_COMMIT; [ "${run#a}" != "$run" ] && tree=$A rev=$A_REV
      (cd "$tree" && PYTHONPATH="$tree/src:$PYTHONPATH" OFFLOAD_RUNNER_COMMIT=$rev \
        suite "$SUITE" "$WORK/$run" "$OUT/results-$SUITE-$run.json")
    done ;;
  *) echo "unknown step $1: tests, suite SUITE, profile SUITE or commit-ab" >&2; exit 2 ;;
esac
