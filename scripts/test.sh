#!/usr/bin/env bash
# Runs the tests of every module as a user builds it: from the module's own
# directory, with GOWORK=off, under the race detector. Arguments go to
# go test (for example -count=1 or -run TestX).
#
# The containerd module's tests start a real containerd from the machine's
# package and skip, saying how to install it, when there is none;
# EVENTMONITOR_REQUIRE_CONTAINERD=1 makes that a failure (CI sets it).
set -euo pipefail
cd "$(dirname "$0")/.."
for dir in $(scripts/modules.sh list); do
	(cd "$dir" && GOWORK=off go test -race "$@" ./...)
done
