#!/usr/bin/env bash
# Build kube-apiserver, kube-controller-manager, kube-scheduler, kubectl and etcd
# from the Go tools module (tools/) into a cache directory OUTSIDE the repository, keyed by
# a hash of the module's inputs, and print that bin directory on stdout (last
# line; everything else goes to stderr).
#
# A second run, or a fresh clone on the same machine, finds the binaries and
# does nothing.  A cold build (empty Go build cache) took ~5 minutes on 2 fast
# cores; allow 15-25 on slower machines (adding kube-scheduler, BUILD_REV=2, took
# 16 s with a warm Go build cache).  The Go module and build caches
# (go env GOMODCACHE GOCACHE) make rebuilds after a key change much faster.
#
# Usage: hack/cluster/build-tools.sh [--print]
#   --print   only print the bin dir; exit 1 if the binaries are not built yet.
#
# Environment:
#   GO                     go command (default: `go` on PATH, else /usr/local/go/bin/go)
#   VIDEOJOB_TOOLS_CACHE   cache root (default: ${XDG_CACHE_HOME:-$HOME/.cache}/videojob)
#   GOFLAGS                passed through (e.g. GOFLAGS=-p=2 to bound parallelism)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
tools="$repo/tools"
BINARIES=(kube-apiserver kube-controller-manager kube-scheduler kubectl etcd)
# Bump when the way binaries are built changes (flags, ldflags, packages).
BUILD_REV=2

log() { printf 'build-tools: %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

print_only=0
case "${1:-}" in
  --print) print_only=1 ;;
  "") ;;
  -h|--help) sed -n '2,18p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
  *) die "unknown argument: $1" ;;
esac

[[ -f "$tools/go.mod" && -f "$tools/go.sum" ]] || die "missing $tools/go.mod or go.sum"

# Version of k8s.io/kubernetes pinned by tools/go.mod (no go command needed).
k8s_version="$(awk '$1=="k8s.io/kubernetes" && $2 ~ /^v1\./ {print $2; exit}' "$tools/go.mod")"
[[ -n "$k8s_version" ]] || die "cannot find the k8s.io/kubernetes requirement in tools/go.mod"

hash="$(
  {
    echo "rev=$BUILD_REV"
    grep -v '^[[:space:]]*//' "$tools/go.mod"  # comment edits do not force a rebuild
    cat "$tools/go.sum"
    # not the nested tool modules (tools/<name>/go.mod): build-gotool.sh builds those
    find "$tools" -mindepth 1 -type d -exec test -e '{}/go.mod' ';' -prune \
      -o -name '*.go' -type f -print | LC_ALL=C sort | xargs cat
  } | sha256sum | cut -c1-16
)"
cache_root="${VIDEOJOB_TOOLS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/videojob}"
key_dir="$cache_root/k8s-${k8s_version}-${hash}"
bin_dir="$key_dir/bin"

have_all() {
  local b
  for b in "${BINARIES[@]}"; do [[ -x "$bin_dir/$b" ]] || return 1; done
}

if have_all; then
  log "up to date: $bin_dir"
  echo "$bin_dir"
  exit 0
fi
if [[ $print_only == 1 ]]; then
  log "not built yet: $bin_dir (run hack/cluster/build-tools.sh)"
  exit 1
fi

if [[ -z "${GO:-}" ]]; then
  if command -v go >/dev/null 2>&1; then GO=go
  elif [[ -x /usr/local/go/bin/go ]]; then GO=/usr/local/go/bin/go
  else die "no go toolchain found (set GO=/path/to/go; Go >= 1.24 is required)"
  fi
fi

mkdir -p "$key_dir"
# One build at a time per key (parallel `make cluster-up` / pytest sessions).
exec 9>"$key_dir/.lock"
if ! flock -n 9; then
  log "another build holds $key_dir/.lock; waiting for it"
  flock 9
fi
if have_all; then
  log "built by a concurrent run: $bin_dir"
  echo "$bin_dir"
  exit 0
fi

tmp="$key_dir/bin.tmp.$$"
rm -rf "$tmp"
mkdir -p "$tmp"
trap 'rm -rf "$tmp"' EXIT

# Version stamping, as the kubernetes release build does (hack/lib/version.sh).
minor="${k8s_version#v1.}"; minor="${minor%%.*}"
ldflags="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  ldflags+=" -X $pkg.gitVersion=$k8s_version -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
  ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
done

log "building ${BINARIES[*]} for kubernetes $k8s_version with $("$GO" version)"
log "into $bin_dir (a cold build takes ~5-25 minutes)"
start=$(date +%s)
(
  cd "$tools"
  # -dwarf=false: the compiler's debug info is thrown away at link (-w) anyway; not making it
  # saved 11% of a cold build's CPU (548 against 618 CPU-seconds, measured 2026-12-07). The
  # binaries are the same, so BUILD_REV stays. GOGC=400: the compiler's heap is collected less
  # often; a cold KWOK build took 158-168 CPU-seconds against 190-196 at Go's default 100 (two
  # pairs, 2026-12-07, /usr/bin/time of the same go build with an empty GOCACHE), the same binary.
  GOGC="${GOGC:-400}" CGO_ENABLED=0 "$GO" build -trimpath -gcflags=all=-dwarf=false -ldflags="$ldflags" -o "$tmp/" \
    k8s.io/kubernetes/cmd/kube-apiserver \
    k8s.io/kubernetes/cmd/kube-controller-manager \
    k8s.io/kubernetes/cmd/kube-scheduler \
    k8s.io/kubernetes/cmd/kubectl \
    ./cmd/etcd
) >&2 || die "go build failed (see above)"

for b in "${BINARIES[@]}"; do [[ -x "$tmp/$b" ]] || die "go build did not produce $b"; done
secs=$(( $(date +%s) - start ))
echo "$secs" > "$tmp/.build-seconds"  # the cold build's cost (benchmarks/test_suite.py reads it)
rm -rf "$bin_dir"
mv "$tmp" "$bin_dir"
trap - EXIT
log "built in ${secs}s: $bin_dir"
echo "$bin_dir"
