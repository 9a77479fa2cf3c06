#!/usr/bin/env bash
# `make test`: the suite as two pytest processes at once (tests/streams.py): one for the
# modules that use a loopback control plane, one for the rest. On this 2-core machine the
# suite alone kept 1.2 cores busy (59%, measured by tests/suite_timings.py); side by side
# the two streams took 22m22s where one process took 36m55s (issue 35, docs/development.md).
#
#   hack/test_streams.sh PYTHON [PYTEST ARGS...]
#
# Each stream writes out/test-stream-NAME.log and out/test-timings-NAME.json; both logs are
# printed when both have ended. Exit status: 0 when both passed; pytest's "collected
# nothing" (5) is a failure here, never a pass.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
python=$1
shift
mkdir -p out
rm -f out/test-timings.json out/test-timings-cluster.json out/test-timings-local.json
declare -A pids
for stream in cluster local; do
  VIDEOJOB_TEST_STREAM=$stream VIDEOJOB_TEST_TIMINGS=out/test-timings-$stream.json \
    "$python" -m pytest tests -m "not slow" "$@" >"out/test-stream-$stream.log" 2>&1 &
  pids[$stream]=$!
done
failed=""
for stream in cluster local; do
  wait "${pids[$stream]}"
  rc=$?
  [[ $rc -eq 0 ]] || failed="$failed $stream(exit $rc$([[ $rc -eq 5 ]] && echo ': no tests collected'))"
done
for stream in cluster local; do
  echo "======================== stream: $stream (out/test-stream-$stream.log) ========================"
  cat "out/test-stream-$stream.log"
done
if [[ -n "$failed" ]]; then
  echo "make test: failed:$failed" >&2
  exit 1
fi
echo "make test: both streams passed"
