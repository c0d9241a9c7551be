#!/usr/bin/env bash
# Builds containerd 2.x (containerd, ctr, containerd-shim-runc-v2) from the Go
# module proxy once, caches the binaries by version outside the repository,
# and runs the containerd module's tests against them.
#
#   scripts/containerd2.sh build            # build into the cache if missing; print the bin dir
#   scripts/containerd2.sh test [go test flags...]   # build if missing, then test
#
# CONTAINERD2_VERSION picks the version (default below); EVENTMONITOR_CACHE
# the cache directory (default ${XDG_CACHE_HOME:-$HOME/.cache}/eventmonitor).
# A cold build takes about 8 minutes on 2 CPUs; a warm cache, none.
set -euo pipefail
cd "$(dirname "$0")/.."

version=${CONTAINERD2_VERSION:-v2.4.2}
cache=${EVENTMONITOR_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/eventmonitor}
bin="$cache/containerd-$version/bin"
tools="containerd ctr containerd-shim-runc-v2"

build() {
	local missing=
	for tool in $tools; do
		[ -x "$bin/$tool" ] || missing=1
	done
	[ -z "$missing" ] && return
	echo "containerd2: building containerd $version into $bin (about 8 minutes cold)" >&2
	local work
	work=$(mktemp -d)
	trap 'rm -rf "$work"' RETURN
	mkdir -p "$(dirname "$bin")"
	# An empty module of its own: containerd's go.mod, not ours, decides its
	# dependencies. The btrfs, devmapper and zfs snapshotters need C headers
	# the tests do not use.
	(
		cd "$work"
		export GOWORK=off GOFLAGS= GOBIN="$work/bin"
		go mod init containerd2-build >/dev/null 2>&1
		for tool in containerd ctr containerd-shim-runc-v2; do
			go install -tags no_btrfs,no_devmapper,no_zfs \
				"github.com/containerd/containerd/v2/cmd/$tool@$version"
		done
	)
	rm -rf "$bin.partial"
	mv "$work/bin" "$bin.partial"
	rm -rf "$bin"
	mv "$bin.partial" "$bin" # only a complete set is ever in place
}

case "${1:-}" in
build)
	build
	echo "$bin"
	;;
test)
	shift
	build
	export PATH="$bin:$PATH"
	containerd --version
	cd containerd
	go test "$@" ./...
	;;
*)
	echo "usage: $0 build | test [go test flags...]" >&2
	exit 2
	;;
esac
