#!/usr/bin/env bash
# Build one Go tool module under tools/<name>/ (its own go.mod and go.sum, so its
# Kubernetes library versions never have to agree with tools/ itself) into a
# cache directory OUTSIDE the repository, keyed by a hash of the module's
# inputs, and print that bin directory on stdout (last line; logs go to stderr).
#
# tools/<name>/packages lists what to build, one line each:
#     <package import path> <binary name>
# tools/<name>/ldflags (optional) holds extra -ldflags (version stamping).
#
# A second run, or a fresh clone on the same machine, finds the binaries and
# does nothing. Cold build times per tool are in tools/<name>/packages' header.
#
# Usage: hack/cluster/build-gotool.sh <name> [--print]
#   --print   only print the bin dir; exit 1 if the binaries are not built yet.
# Environment: GO, VIDEOJOB_TOOLS_CACHE, GOFLAGS as for build-tools.sh.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
# Bump when the way binaries are built changes (flags, layout).
BUILD_REV=1

log() { printf 'build-gotool: %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

name="${1:-}"
[[ -n "$name" && "$name" != -* ]] || die "usage: build-gotool.sh <name> [--print]"
print_only=0
case "${2:-}" in
  --print) print_only=1 ;;
  "") ;;
  *) die "unknown argument: $2" ;;
esac

mod="$repo/tools/$name"
[[ -f "$mod/go.mod" && -f "$mod/go.sum" && -f "$mod/packages" ]] \
  || die "tools/$name needs go.mod, go.sum and packages"

mapfile -t lines < <(grep -v '^[[:space:]]*\(#\|$\)' "$mod/packages")
(( ${#lines[@]} )) || die "tools/$name/packages lists nothing"
pkgs=(); bins=()
for line in "${lines[@]}"; do
  read -r pkg bin _ <<<"$line"
  [[ -n "$pkg" && -n "$bin" ]] || die "bad line in tools/$name/packages: $line"
  pkgs+=("$pkg"); bins+=("$bin")
done
ldflags="-s -w"
[[ -f "$mod/ldflags" ]] && ldflags+=" $(grep -v '^[[:space:]]*#' "$mod/ldflags" | tr '\n' ' ')"

hash="$(
  {
    echo "rev=$BUILD_REV"
    grep -v '^[[:space:]]*//' "$mod/go.mod"
    cat "$mod/go.sum"
    printf '%s\n' "${lines[@]}"  # packages without comments: editing its header does not rebuild
    [[ -f "$mod/ldflags" ]] && grep -v '^[[:space:]]*#' "$mod/ldflags"
    find "$mod" -name '*.go' -type f | LC_ALL=C sort | xargs -r cat
  } | sha256sum | cut -c1-16
)"
cache_root="${VIDEOJOB_TOOLS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/videojob}"
key_dir="$cache_root/$name-$hash"
bin_dir="$key_dir/bin"

have_all() {
  local b
  for b in "${bins[@]}"; do [[ -x "$bin_dir/$b" ]] || return 1; done
}

if have_all; then log "up to date: $bin_dir"; echo "$bin_dir"; exit 0; fi
if [[ $print_only == 1 ]]; then
  log "not built yet: $bin_dir (run hack/cluster/build-gotool.sh $name)"; exit 1
fi

if [[ -z "${GO:-}" ]]; then
  if command -v go >/dev/null 2>&1; then GO=go
  elif [[ -x /usr/local/go/bin/go ]]; then GO=/usr/local/go/bin/go
  else die "no go toolchain found (set GO=/path/to/go)"
  fi
fi

mkdir -p "$key_dir"
exec 9>"$key_dir/.lock"
if ! flock -n 9; then log "another build holds $key_dir/.lock; waiting for it"; flock 9; fi
if have_all; then log "built by a concurrent run: $bin_dir"; echo "$bin_dir"; exit 0; fi

tmp="$key_dir/bin.tmp.$$"
rm -rf "$tmp"; mkdir -p "$tmp"
trap 'rm -rf "$tmp"' EXIT

log "building ${bins[*]} from tools/$name with $("$GO" version) into $bin_dir"
start=$(date +%s)
for i in "${!pkgs[@]}"; do
  # -dwarf=false: as in build-tools.sh (debug info that -w drops at link; 11% of the CPU);
  # GOGC=400: as in build-tools.sh (the compiler collects less often; 15% less CPU)
  ( cd "$mod" && GOGC="${GOGC:-400}" CGO_ENABLED=0 "$GO" build -trimpath -gcflags=all=-dwarf=false -ldflags="$ldflags" \
      -o "$tmp/${bins[$i]}" "${pkgs[$i]}" ) >&2 || die "go build of ${pkgs[$i]} failed (see above)"
done
for b in "${bins[@]}"; do [[ -x "$tmp/$b" ]] || die "go build did not produce $b"; done
secs=$(( $(date +%s) - start ))
echo "$secs" > "$tmp/.build-seconds"  # the cold build's cost (benchmarks/test_suite.py reads it)
rm -rf "$bin_dir"; mv "$tmp" "$bin_dir"; trap - EXIT
log "built in ${secs}s: $bin_dir"
echo "$bin_dir"
