GO ?= go
GOFILES = $$(git ls-files --cached --others --exclude-standard '*.go')

.PHONY: test chaos services vet quickstart ci fuzz bench-outbox bench-dedup bench-kafka bench-nats bench-brokers bench-bound

# Start (or check) the services the integration tests use, then run all
# tests: the library's, then the benchmarks' (benchmarks/ is a module of its
# own, so that its dependencies stay out of the library's go.mod, and the
# root's ./... does not reach it). benchmarks/nats and benchmarks/brokers
# run without -race:
# watermill-nats v2.1.3, the baseline it measures, sends on a channel while
# closing it (ThreeDotsLabs/watermill-nats#18); oncemill's own NATS adapter
# does not use it and runs under -race with the library. The adapters'
# package runs a minute-long outage on every broker, past go test's
# default 10m per package on a loaded machine: hence -timeout 30m.
test: services
	$(GO) test -race -count=1 -timeout 30m ./...
	cd benchmarks && $(GO) test -race -count=1 $$($(GO) list ./... | grep -Ev '/benchmarks/(nats|brokers)$$')
	cd benchmarks && $(GO) test -count=1 ./nats/ ./brokers/

# The chaos suite (build tag chaos): consumer processes on Kafka, RabbitMQ,
# SQS and NATS SIGKILLed at random while PostgreSQL, RabbitMQ, Redis and
# NATS restart under them (private instances); prints what was sent,
# applied, doubled, lost and dead-lettered, and the longest stall, per
# broker and fault.
# Without -race: watermill-amqp v3.0.2 races on its connection field when
# it reconnects (ThreeDotsLabs/watermill#693), which the RabbitMQ restart
# makes it do.
chaos: services
	$(GO) test -tags chaos -count=1 -v -timeout 20m ./chaos/

services:
	bash scripts/services.sh

# go vet of both modules, plus a gofmt check that lists unformatted files
# (the benchmarks' included).
vet:
	$(GO) vet ./...
	$(GO) vet -tags chaos ./chaos/
	cd benchmarks && $(GO) vet ./...
	@files="$(GOFILES)"; unformatted="$$(test -z "$$files" || gofmt -l $$files)"; \
	if [ -n "$$unformatted" ]; then echo "gofmt -l found unformatted files:"; echo "$$unformatted"; exit 1; fi

quickstart:
	$(GO) run ./examples/quickstart

# Every fuzz target of the library, one after the other, each for
# FUZZTIME with one worker; see scripts/fuzz.sh. New failing inputs land
# in the package's testdata/fuzz/<target>/; see docs/testing.md.
FUZZTIME ?= 15s
fuzz: services
	GO=$(GO) bash scripts/fuzz.sh $(FUZZTIME)

ci: vet test chaos quickstart

# The bench targets run in benchmarks/, the benchmarks' own module: a
# relative path in ARGS is taken from there. The commands find the results
# files they write wherever they run in the repository.

# Outbox relay benchmark: oncemill's relay vs Watermill's forwarder on the
# PostgreSQL of DATABASE_URL; writes benchmarks/README.md. ARGS=-quick for
# a run under a minute (which writes nothing).
bench-outbox:
	bash scripts/services.sh postgres
	cd benchmarks && $(GO) run ./outbox $(ARGS)

# Deduplication benchmark: every dedup strategy on one generated stream,
# speed and correctness under crashes, on the PostgreSQL of DATABASE_URL and
# the Redis of REDIS_URL; writes benchmarks/RESULTS.md,
# benchmarks/dedup/results.csv and throughput.png. ARGS=-quick for a run
# under a minute (which writes nothing).
bench-dedup:
	bash scripts/services.sh postgres redis
	cd benchmarks && $(GO) run ./dedup $(ARGS)

# Kafka end-to-end benchmark: watermill-kafka's subscriber and oncemill's
# (one in flight, key-parallel, key-parallel without the inbox) consuming
# from the embedded broker into the PostgreSQL inbox of DATABASE_URL, on 1
# and 8 partitions; fails on any doubled, lost or out-of-order effect;
# writes the "Kafka end to end" section of benchmarks/README.md and
# benchmarks/kafka/throughput.png. ARGS=-quick for a run under a minute
# (which writes nothing).
bench-kafka:
	bash scripts/services.sh postgres
	cd benchmarks && $(GO) run ./kafka $(ARGS)

# NATS end-to-end benchmark: watermill-nats's JetStream subscribers
# (pkg/nats, pkg/jetstream) and oncemill's (1 and 16 in flight), the same
# handler under the PostgreSQL inbox of DATABASE_URL, on the NATS server of
# NATS_URL (default 127.0.0.1:4222; ARGS=-nats=embedded for one in
# process): throughput, latency at a steady rate, and the redeliveries of
# a handler slower than AckWait; fails on any doubled or lost effect;
# writes the "NATS end to end" section of benchmarks/README.md. ARGS=-quick
# for a run under a minute (which writes nothing).
bench-nats:
	bash scripts/services.sh postgres nats
	cd benchmarks && $(GO) run ./nats $(ARGS)

# RabbitMQ and NATS, the subscribers compared: the stock Watermill
# subscriber (watermill-amqp, watermill-nats) and oncemill's under the same
# PostgreSQL inbox, oncemill's with group commit and BatchHandler, and
# oncemill's with no inbox; fails on any doubled, lost or reordered effect;
# writes the "RabbitMQ and NATS: the subscribers" section of
# benchmarks/README.md. ARGS=-quick for a run under a minute (which writes
# nothing).
bench-brokers:
	bash scripts/services.sh postgres rabbitmq nats
	cd benchmarks && $(GO) run ./brokers $(ARGS)

# The server-side bound of the inbox's new-key paths: the statements the
# inbox sends, replayed by pgbench on the PostgreSQL of DATABASE_URL and by
# mariadb-slap on the MariaDB of MYSQL_URL, against the hand-written SQL
# bench-dedup and bench-kafka compare with; prints the ratios. ARGS=-dbs
# postgres for one database.
bench-bound:
	bash scripts/services.sh postgres mariadb
	cd benchmarks && $(GO) run ./bound $(ARGS)
