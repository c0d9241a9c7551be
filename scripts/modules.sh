#!/usr/bin/env bash
# The repository's Go modules, released together under one version (the
# VERSION file), each requiring its siblings at that version and replacing
# them with their directories for local development only.
#
#   scripts/modules.sh list               # the module directories, root first
#   scripts/modules.sh check              # each module builds, vets and tidies on its own (GOWORK=off)
#   scripts/modules.sh set-version vX.Y.Z # require every sibling at vX.Y.Z and write VERSION
#   scripts/modules.sh consumer           # a module outside the repo builds against them as released
#   scripts/modules.sh tags               # the tags a release of VERSION pushes
#
# See RELEASING.md.
set -euo pipefail
cd "$(dirname "$0")/.."

root=github.com/eventmonitor/eventmonitor
dirs=". containerd prometheus examples bench"
version=$(cat VERSION)

# path_of DIR: the module path of the module in DIR.
path_of() { if [ "$1" = . ]; then echo "$root"; else echo "$root/$1"; fi; }

# siblings DIR: the directories of the repository's modules that DIR requires.
siblings() {
	local dir=$1 other
	for other in $dirs; do
		[ "$other" = "$dir" ] && continue
		if (cd "$dir" && go mod edit -print) | grep -Eq "^[[:space:]]*(require[[:space:]]+)?$(path_of "$other") v"; then
			echo "$other"
		fi
	done
}

# relative FROM TO: the path of module directory TO from module directory FROM.
relative() {
	local from=$1 to=$2
	if [ "$from" = . ]; then echo "./$to"; elif [ "$to" = . ]; then echo "../"; else echo "../$to"; fi
}

check() {
	local failed= dir other printed
	for dir in $dirs; do
		echo "modules: $dir" >&2
		printed=$(cd "$dir" && go mod edit -print)
		for other in $(siblings "$dir"); do
			if ! grep -Eq "^[[:space:]]*(require[[:space:]]+)?$(path_of "$other") $version\$" <<<"$printed"; then
				echo "modules: $dir requires $(path_of "$other") at another version than $version (VERSION)" >&2
				failed=1
			fi
			if ! grep -Eq "^replace $(path_of "$other") => $(relative "$dir" "$other")\$" <<<"$printed"; then
				echo "modules: $dir lacks 'replace $(path_of "$other") => $(relative "$dir" "$other")'" >&2
				failed=1
			fi
		done
		# Built as a user builds it: on its own, with its own go.sum and no
		# -mod=mod to paper over a missing entry.
		if ! (cd "$dir" && GOWORK=off GOFLAGS=-mod=readonly go mod tidy -diff >&2); then
			echo "modules: go mod tidy would change $dir (the diff is above)" >&2
			failed=1
		fi
		(cd "$dir" && GOWORK=off GOFLAGS=-mod=readonly go build -o /dev/null ./... && GOWORK=off GOFLAGS=-mod=readonly go vet ./...) || failed=1
	done
	[ -z "$failed" ]
}

# consumer builds scripts/consumer.go (the README's tour) as a module of a
# user's would: against the modules as a release of VERSION would serve them
# (a file GOPROXY made from the tracked files), without our replace
# directives, from a go.mod that says go 1.23.0, which must not change.
consumer() {
	local work
	work=$(mktemp -d)
	trap 'rm -rf "$work"' RETURN
	GOWORK=off GOFLAGS= go run scripts/proxy.go -version "$version" -out "$work/proxy" . containerd prometheus
	mkdir "$work/consumer"
	sed '/^\/\/go:build ignore$/d' scripts/consumer.go >"$work/consumer/main.go"
	printf 'module example.com/consumer\n\ngo 1.23.0\n' >"$work/consumer/go.mod"
	(
		cd "$work/consumer"
		export GOWORK=off GOFLAGS=-mod=mod GONOSUMDB=github.com/eventmonitor
		export GOPROXY="file://$work/proxy,$(go env GOPROXY)"
		go get "$root@$version" "$root/containerd@$version" "$root/prometheus@$version"
		go mod tidy
		go build ./...
		go vet ./...
		if ! grep -qx 'go 1.23.0' go.mod; then
			echo "modules: building against the modules changed a Go 1.23 user's go directive:" >&2
			grep '^go ' go.mod >&2
			exit 1
		fi
	)
	echo "modules: a consumer builds against $version with Go 1.23's go directive" >&2
}

set_version() {
	local new=$1 dir other
	[[ $new =~ ^v[0-9]+\.[0-9]+\.[0-9]+(-[0-9A-Za-z.-]+)?$ ]] || { echo "modules: $new is not a semantic version" >&2; exit 2; }
	for dir in $dirs; do
		for other in $(siblings "$dir"); do
			(cd "$dir" && go mod edit -require="$(path_of "$other")@$new")
		done
	done
	echo "$new" >VERSION
}

case "${1:-}" in
list) echo $dirs ;;
check) check ;;
consumer) consumer ;;
set-version) set_version "${2:?usage: $0 set-version vX.Y.Z}" ;;
tags)
	for dir in $dirs; do
		if [ "$dir" = . ]; then echo "$version"; else echo "$dir/$version"; fi
	done
	;;
*)
	echo "usage: $0 list | check | set-version vX.Y.Z | tags" >&2
	exit 2
	;;
esac
