#!/usr/bin/env bash
# End-to-end on a kind cluster (DESIGN.md "Testing layers", layer 6): build the
# two images, create a kind cluster, load the images, `helm install` the chart
# in embedded mode (Ray inside the operator pod, CPU ranks), apply
# examples/tiny-cpu.yaml, wait for status.phase Succeeded, copy the mp4 out of
# the operator pod's output volume. On failure it dumps diagnostics (pods,
# describe, logs, events); the cluster is deleted on exit either way.
#
# Needs Docker (a reachable daemon) and kind. Where either is missing it says
# so and exits 0 WITHOUT claiming a run (the last line starts with SKIPPED).
# helm comes from hack/cluster/build-gotool.sh helm; kubectl from PATH or
# hack/cluster/build-tools.sh's bin dir.
#
# Usage: hack/kind-e2e.sh            (make kind-e2e)
# Environment:
#   KIND                kind binary (default: kind on PATH)
#   KIND_CLUSTER        cluster name (default: videojob-e2e-<pid>)
#   KIND_NODE_IMAGE     node image for `kind create cluster --image` (default: kind's own)
#   KEEP_CLUSTER=1      do not delete the cluster on exit (debugging)
#   E2E_TIMEOUT_S       seconds to wait for Succeeded (default 900)
#   E2E_OUT             where the mp4 and diagnostics go (default out/kind-e2e)
#   SKIP_BUILD=1        use already built images videojob/operator:e2e, videojob/runtime:e2e
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/.." && pwd)"
cd "$repo"

log() { printf 'kind-e2e: %s\n' "$*" >&2; }
skip() { log "$*"; echo "SKIPPED: kind e2e not run: $*"; exit 0; }
die() { log "ERROR: $*"; exit 1; }

KIND="${KIND:-kind}"
CLUSTER="${KIND_CLUSTER:-videojob-e2e-$$}"
TIMEOUT_S="${E2E_TIMEOUT_S:-900}"
OUT="${E2E_OUT:-$repo/out/kind-e2e}"
NAMESPACE=videojob-e2e
RELEASE=videojob
JOB=tiny-cpu
TAG=e2e
OPERATOR_IMAGE="videojob/operator:$TAG"
RUNTIME_IMAGE="videojob/runtime:$TAG"

# --- what this machine has ----------------------------------------------------
command -v docker >/dev/null 2>&1 || skip "no docker CLI on PATH"
docker_err="$(docker info --format '{{.ServerVersion}}' 2>&1 >/dev/null)" \
  || skip "the docker daemon is not reachable ($(head -n1 <<<"$docker_err"))"
command -v "$KIND" >/dev/null 2>&1 || skip "no kind on PATH (install it, or set KIND=/path/to/kind)"

helm_dir="$(GOFLAGS="${GOFLAGS:+$GOFLAGS }-p=1" bash "$repo/hack/cluster/build-gotool.sh" helm | tail -n1)" \
  || die "could not build helm"
HELM="$helm_dir/helm"
if command -v kubectl >/dev/null 2>&1; then
  KUBECTL=kubectl
elif tools_dir="$(bash "$repo/hack/cluster/build-tools.sh" --print 2>/dev/null | tail -n1)" \
     && [[ -x "$tools_dir/kubectl" ]]; then
  KUBECTL="$tools_dir/kubectl"
else
  die "no kubectl: put one on PATH or run make cluster-tools"
fi

mkdir -p "$OUT"
KUBECONFIG_FILE="$OUT/kubeconfig"
export KUBECONFIG="$KUBECONFIG_FILE"
kc() { "$KUBECTL" --kubeconfig "$KUBECONFIG_FILE" "$@"; }

# --- cleanup and diagnostics ---------------------------------------------------
created=0
succeeded=0
diagnostics() {
  local d="$OUT/diagnostics"
  mkdir -p "$d"
  log "dumping diagnostics to $d"
  kc get nodes -o wide >"$d/nodes.txt" 2>&1 || true
  kc get all,pvc,configmap,videojobs -A -o wide >"$d/objects.txt" 2>&1 || true
  kc -n "$NAMESPACE" get videojob "$JOB" -o yaml >"$d/videojob.yaml" 2>&1 || true
  kc -n "$NAMESPACE" describe videojob "$JOB" >"$d/videojob-describe.txt" 2>&1 || true
  kc -n "$NAMESPACE" describe pods >"$d/pods-describe.txt" 2>&1 || true
  kc -n "$NAMESPACE" describe pvc >"$d/pvc-describe.txt" 2>&1 || true
  kc -n "$NAMESPACE" logs "deploy/$RELEASE" --all-containers --tail=-1 >"$d/operator.log" 2>&1 || true
  kc -n "$NAMESPACE" logs "deploy/$RELEASE" --all-containers --previous --tail=-1 >"$d/operator-previous.log" 2>&1 || true
  kc get events -A --sort-by=.lastTimestamp >"$d/events.txt" 2>&1 || true
  "$HELM" --kubeconfig "$KUBECONFIG_FILE" -n "$NAMESPACE" status "$RELEASE" >"$d/helm-status.txt" 2>&1 || true
  # The last lines of each, where a person looks first.
  for f in videojob-describe.txt operator.log events.txt; do
    log "---- $f (tail) ----"
    tail -n 40 "$d/$f" >&2 || true
  done
}
cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  if [[ $created == 1 && $succeeded != 1 ]]; then diagnostics; fi
  if [[ $created == 1 ]]; then
    if [[ "${KEEP_CLUSTER:-0}" == 1 ]]; then
      log "KEEP_CLUSTER=1: cluster $CLUSTER left running (kind delete cluster --name $CLUSTER)"
    else
      log "deleting kind cluster $CLUSTER"
      "$KIND" delete cluster --name "$CLUSTER" >&2 || true
    fi
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# --- images ---------------------------------------------------------------------
if [[ "${SKIP_BUILD:-0}" != 1 ]]; then
  log "building $OPERATOR_IMAGE (target operator) and $RUNTIME_IMAGE (target runtime)"
  docker build --target operator -t "$OPERATOR_IMAGE" "$repo"
  docker build --target runtime -t "$RUNTIME_IMAGE" "$repo"
fi

# --- cluster ----------------------------------------------------------------------
log "creating kind cluster $CLUSTER"
created=1
kind_args=(create cluster --name "$CLUSTER" --kubeconfig "$KUBECONFIG_FILE" --wait 180s)
[[ -n "${KIND_NODE_IMAGE:-}" ]] && kind_args+=(--image "$KIND_NODE_IMAGE")
"$KIND" "${kind_args[@]}"
log "loading images into the cluster"
# The operator image is loaded too although embedded mode runs the runtime
# image: it checks that the slim image at least loads, and lets a later switch
# to address mode run without a rebuild.
"$KIND" load docker-image --name "$CLUSTER" "$OPERATOR_IMAGE" "$RUNTIME_IMAGE"

# --- install ------------------------------------------------------------------------
kc create namespace "$NAMESPACE"
log "helm install (embedded mode, charts/videojob/ci/embedded.yaml)"
"$HELM" --kubeconfig "$KUBECONFIG_FILE" install "$RELEASE" "$repo/charts/videojob" \
  --namespace "$NAMESPACE" \
  -f "$repo/charts/videojob/ci/embedded.yaml" \
  --set image.operator.repository=videojob/operator --set image.operator.tag="$TAG" \
  --set image.runtime.repository=videojob/runtime --set image.runtime.tag="$TAG" \
  --set image.operator.pullPolicy=Never --set image.runtime.pullPolicy=Never \
  --wait --timeout 10m
kc -n "$NAMESPACE" rollout status "deploy/$RELEASE" --timeout=5m

# --- the job ------------------------------------------------------------------------
log "applying examples/tiny-cpu.yaml"
kc -n "$NAMESPACE" apply -f "$repo/examples/tiny-cpu.yaml"
deadline=$(( $(date +%s) + TIMEOUT_S ))
phase=""
while :; do
  phase="$(kc -n "$NAMESPACE" get videojob "$JOB" -o jsonpath='{.status.phase}' 2>/dev/null || true)"
  case "$phase" in
    Succeeded) break ;;
    Failed|Cancelled) die "VideoJob $JOB ended $phase: $(kc -n "$NAMESPACE" get videojob "$JOB" \
                            -o jsonpath='{.status.message}' 2>/dev/null || true)" ;;
  esac
  (( $(date +%s) < deadline )) || die "VideoJob $JOB not Succeeded within ${TIMEOUT_S}s (phase: ${phase:-none})"
  sleep 5
done
log "VideoJob $JOB Succeeded"
kc -n "$NAMESPACE" get videojob "$JOB" -o wide >&2

# --- the video ------------------------------------------------------------------------
# local://videos/tiny-cpu resolves under VIDEOJOB_OUTPUT_ROOT/<the job's namespace>; the chart
# points the root into the data volume; ask the pod rather than repeat the chart's layout.
pod="$(kc -n "$NAMESPACE" get pods -l app.kubernetes.io/instance="$RELEASE",app.kubernetes.io/component=operator \
        -o jsonpath='{.items[0].metadata.name}')"
root="$(kc -n "$NAMESPACE" exec "$pod" -c operator -- printenv VIDEOJOB_OUTPUT_ROOT)"
uri="$(kc -n "$NAMESPACE" get videojob "$JOB" -o jsonpath='{.spec.output.uri}')"
remote="$root/$NAMESPACE/${uri#local://}/$JOB.mp4"
log "copying $pod:$remote"
kc -n "$NAMESPACE" cp -c operator "$NAMESPACE/$pod:$remote" "$OUT/$JOB.mp4"
size=$(wc -c <"$OUT/$JOB.mp4")
(( size > 0 )) || die "the copied $JOB.mp4 is empty"
head -c 12 "$OUT/$JOB.mp4" | grep -q ftyp || die "$OUT/$JOB.mp4 is not an mp4 (no ftyp box)"
succeeded=1
echo "PASSED: kind e2e: $JOB Succeeded on kind cluster $CLUSTER; video $OUT/$JOB.mp4 ($size bytes)"
