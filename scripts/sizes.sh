#!/usr/bin/env bash
# Binary size and third-party packages of three programs: the quickstart,
# the README's consumer linking RabbitMQ only, and the same linking Kafka
# only. Run from anywhere in the repository: bash scripts/sizes.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

work=$(mktemp -d ./.sizes.XXXXXX)
trap 'rm -rf "$work"' EXIT

# variant DIR BROKER: the README consumer with one broker import.
variant() {
	mkdir -p "$work/$1"
	grep -v -e '_ "github.com/oncemill/oncemill/adapters/' examples/readme/main.go |
		sed "s#^\t\"github.com/oncemill/oncemill/adapters\"\$#&\n\t_ \"github.com/oncemill/oncemill/adapters/$2\"#" >"$work/$1/main.go"
}
variant rabbitmq amqp
variant kafka kafka

printf '%-28s %10s %10s %9s %8s\n' program "size (MB)" "-s -w (MB)" packages modules
for p in ./examples/quickstart "./$work/rabbitmq" "./$work/kafka"; do
	go build -o "$work/bin" "$p"
	go build -ldflags='-s -w' -o "$work/bin-stripped" "$p"
	pkgs=$(go list -deps -f '{{if .Module}}{{if not .Module.Main}}{{.ImportPath}}{{end}}{{end}}' "$p" | sort -u | wc -l)
	mods=$(go list -deps -f '{{if .Module}}{{if not .Module.Main}}{{.Module.Path}}{{end}}{{end}}' "$p" | sort -u | wc -l)
	name=${p#./}
	name=${name#"$work/"}
	awk -v n="$name" -v a="$(stat -c %s "$work/bin")" -v b="$(stat -c %s "$work/bin-stripped")" -v p="$pkgs" -v m="$mods" \
		'BEGIN { printf "%-28s %10.1f %10.1f %9d %8d\n", n, a/1e6, b/1e6, p, m }'
done
