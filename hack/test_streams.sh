#!/usr/bin/env bash
# `make test`: what the suite needs, then the suite as two pytest processes at once
# (tests/streams.py): one for the modules that use a loopback control plane, one for the
# rest. On this 2-core machine the suite alone kept 1.2 cores busy (59%, measured by
# tests/suite_timings.py); side by side the two streams took 22m22s where one process took
# 36m55s (issue 35, docs/development.md).
#
#   hack/test_streams.sh PYTHON [PYTEST ARGS...]
#
# What it needs is made here, so that a machine with no caches loses as little as it can
# (issue 35: 40 minutes then, 30 with the Go tools cached):
#   1. the venv (`make venv`) and the control plane's binaries (build-tools.sh) side by side;
#   2. both streams start when those two are there;
#   3. the other Go tools that are not cached yet (helm, KWOK, KubeRay, Kueue) build
#      meanwhile at nice 19, on the CPU the tests leave idle (the cores were 87% busy). Their
#      names go to the streams in VIDEOJOB_TOOLS_PENDING: the modules that need one run last
#      in their stream (tests/resource_order.py), and a test that gets there first waits for
#      the build (build-gotool.sh's lock), or starts it.
# With every tool cached (CI's machine) steps 1 and 3 only check the caches.
#
# Each stream writes out/test-stream-NAME.log and out/test-timings-NAME.json; both logs are
# printed when both have ended. out/setup-timings.json holds when each part was ready
# (benchmarks/test_suite.py reads it). Exit status: 0 when everything built and both
# streams passed; pytest's "collected nothing" (5) is a failure here, never a pass.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
python=$1
shift
mkdir -p out
rm -f out/test-timings.json out/test-timings-cluster.json out/test-timings-local.json out/setup-timings.json
start=$(date +%s)
since() { echo $(( $(date +%s) - start )); }
# The tools the background builds, in the order the late modules need them.
OTHER_TOOLS=(helm kwok kuberay kueue)

bash hack/cluster/build-tools.sh >out/setup-control-plane.log 2>&1 &
control_plane_pid=$!
"${MAKE:-make}" --no-print-directory venv
venv_rc=$?
venv_secs=$(since)
wait "$control_plane_pid"
control_plane_rc=$?
control_plane_secs=$(since)
cat out/setup-control-plane.log
if [[ $venv_rc -ne 0 || $control_plane_rc -ne 0 ]]; then
  echo "make test: could not make what the tests need:$([[ $venv_rc -ne 0 ]] && echo " the venv (exit $venv_rc)")$([[ $control_plane_rc -ne 0 ]] && echo " the control plane's binaries (exit $control_plane_rc, out/setup-control-plane.log)")" >&2
  exit 1
fi

pending=()
for tool in "${OTHER_TOOLS[@]}"; do
  bash hack/cluster/build-gotool.sh "$tool" --print >/dev/null 2>&1 || pending+=("$tool")
done
builder_pid=""
if (( ${#pending[@]} )); then
  echo "make test: building ${pending[*]} beside the tests at nice 19 (out/setup-other-tools.log)"
  (
    for tool in "${pending[@]}"; do
      nice -n 19 bash hack/cluster/build-gotool.sh "$tool" || { echo "build of $tool failed" >&2; exit 1; }
    done
  ) >out/setup-other-tools.log 2>&1 &
  builder_pid=$!
fi
streams_secs=$(since)

declare -A pids
pending_list=$(IFS=,; echo "${pending[*]}")
for stream in cluster local; do
  VIDEOJOB_TEST_STREAM=$stream VIDEOJOB_TEST_TIMINGS=out/test-timings-$stream.json \
    VIDEOJOB_TOOLS_PENDING=$pending_list \
    "$python" -m pytest tests -m "not slow" "$@" >"out/test-stream-$stream.log" 2>&1 &
  pids[$stream]=$!
done
failed=""
other_tools_secs=null
if [[ -n "$builder_pid" ]]; then
  wait "$builder_pid" || failed="$failed other-go-tools(out/setup-other-tools.log)"
  other_tools_secs=$(since)
fi
for stream in cluster local; do
  wait "${pids[$stream]}"
  rc=$?
  [[ $rc -eq 0 ]] || failed="$failed $stream(exit $rc$([[ $rc -eq 5 ]] && echo ': no tests collected'))"
done
printf '{"venvSeconds": %s, "controlPlaneToolsSeconds": %s, "streamsStartSeconds": %s, "otherToolsBuilt": [%s], "otherToolsSeconds": %s, "streamsEndSeconds": %s}\n' \
  "$venv_secs" "$control_plane_secs" "$streams_secs" "$( (( ${#pending[@]} )) && printf '"%s",' "${pending[@]}" | sed 's/,$//')" \
  "$other_tools_secs" "$(since)" >out/setup-timings.json
[[ -n "$builder_pid" ]] && cat out/setup-other-tools.log
for stream in cluster local; do
  echo "======================== stream: $stream (out/test-stream-$stream.log) ========================"
  cat "out/test-stream-$stream.log"
done
if [[ -n "$failed" ]]; then
  echo "make test: failed:$failed" >&2
  exit 1
fi
echo "make test: both streams passed"
