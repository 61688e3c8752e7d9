#!/usr/bin/env bash
# Runs every fuzz target of the library, one after the other, each for
# $1 (a -fuzztime) with one worker, so that fuzzing does not starve the
# machine. The packages are those with a func Fuzz in a test file, and
# their targets what go test -list reports, so a new target runs without
# being named here.
#
# A target fails when the fuzzer reports a failing input (written to the
# package's testdata/fuzz/<target>/) or any failure other than one: Go
# 1.26's fuzz coordinator can report "context deadline exceeded" at the
# -fuzztime boundary with no input (golang/go#75804, fixed in Go 1.27).
# That failure is rerun once; only a second one in a row is taken as the
# toolchain's, said, and not counted.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

fuzztime="${1:-15s}"
go="${GO:-go}"
out="$(mktemp)"
trap 'rm -f "$out"' EXIT

# deadline_race: the run's only failure is the coordinator's deadline,
# with no failing input written.
deadline_race() {
	! grep -q 'Failing input written' "$out" &&
		[ "$(grep -c -- '^--- FAIL' "$out")" = 1 ] &&
		grep -A1 -- '^--- FAIL: Fuzz' "$out" | tail -n1 | grep -qx '[[:space:]]*context deadline exceeded'
}

for dir in $(grep -rl --include='*_test.go' '^func Fuzz' . | grep -v '^./benchmarks/' | xargs -r -n1 dirname | sort -u); do
	targets="$("$go" test -list '^Fuzz' "$dir")" || { echo "$targets"; exit 1; }
	for target in $(echo "$targets" | grep '^Fuzz'); do
		for try in 1 2; do
			echo "==> $dir $target ($fuzztime)"
			if "$go" test -run '^$' -fuzz "^$target\$" -fuzztime "$fuzztime" -parallel 1 "$dir" 2>&1 | tee "$out"; then
				break
			fi
			if ! deadline_race; then
				exit 1
			fi
			if [ "$try" = 2 ]; then
				echo "==> $target: the fuzz coordinator's deadline race again (golang/go#75804), no failing input: not counted"
			else
				echo "==> $target: the fuzz coordinator's deadline race (golang/go#75804), no failing input: once more"
			fi
		done
	done
done
