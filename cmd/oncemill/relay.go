package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/oncemill/oncemill/adapters"
	"github.com/oncemill/oncemill/forwarder"
	"github.com/oncemill/oncemill/internal/redact"
	"github.com/oncemill/oncemill/observe"
	"github.com/oncemill/oncemill/observe/prom"
	"github.com/oncemill/oncemill/sqlschema"
)

const (
	// relayEnvPrefix starts the variable of each relay flag that has no
	// variable of its own: --batch-size is $ONCEMILL_RELAY_BATCH_SIZE.
	relayEnvPrefix = "ONCEMILL_RELAY_"
	// defaultRelayListen is where the relay serves /healthz and /metrics
	// without --listen: every interface, so that a probe or a scraper of
	// the pod or host reaches it.
	defaultRelayListen = ":9464"
	// relayHealthTimeout bounds the database ping of one /healthz request.
	relayHealthTimeout = 2 * time.Second
	// relayGroup is the consumer group the relay opens the broker with: it
	// only publishes, the group merely satisfies brokers whose URL needs
	// one (Kafka). A group the URL names is taken as it is.
	relayGroup = "oncemill-relay"
)

// relayHelp is the relay's help after its synopsis.
const relayHelp = `Relays the outbox table of a service to a broker, as forwarder.Relay does
in a Go service: it publishes the committed rows (topic, uuid, payload,
metadata), in per-key order, and deletes them. It is the relay for
services written in other languages, run as a sidecar: the service
inserts its outbox rows in its business transactions, this command
publishes them.

It runs until SIGTERM or SIGINT, then takes no new batch, lets the batch
in flight finish publishing and deleting its rows within --drain-timeout
(past it the batch is rolled back and its rows stay for the next run),
and exits 0. A relay killed outright publishes its last batch again on
the next run, with the same UUIDs, which the consumers' inboxes absorb.

Several copies may run at once on one table, for availability or
throughput: each batch locks a set of the table's 64 lanes (a hash of the
partition key), so no row goes out twice in normal operation and each
key's rows keep their order.

The outbox table belongs to the service: the relay refuses to start when
it (or the SQLite file of --database) does not exist, unless --migrate
creates it (sqlschema.Migrate's tables, on PostgreSQL, MySQL or SQLite).

On --listen it serves /healthz (200 while the relay runs and its database
answers, 503 otherwise) and /metrics (Prometheus: oncemill_outbox_* as
observe/prom exports them, and the process's go_* and process_* series).

It logs to standard error in slog's text format (time=… level=… msg=…),
its own lines ("oncemill relay running", with the outbox and the broker)
and those of the forwarder and the broker's adapter alike, as a consumer
logging to slog.Default() does.

Every flag can also be set by an environment variable: --database by
$DATABASE_URL, --broker by $BROKER_URL, any other by $ONCEMILL_RELAY_
and its name in capitals with '_' for '-' ($ONCEMILL_RELAY_BATCH_SIZE).
A flag beats its variable.`

// relayOptions is "oncemill relay"'s command line, checked.
type relayOptions struct {
	db      *dbURL
	broker  string
	listen  string
	migrate bool
	// cfg is the relay's configuration as the flags give it: its Schema
	// and its settings, without the database and the broker.
	cfg forwarder.RelayConfig
	// fromEnv holds the flags set from their variables, which errors name.
	fromEnv map[string]bool
}

// field names flag for an error: the flag, or its variable when that set it.
func (o relayOptions) field(flag string) string {
	if o.fromEnv[flag] {
		return "$" + relayEnv(flag) + " (--" + flag + ")"
	}
	return "--" + flag
}

// relayEnv is the variable of flag name.
func relayEnv(name string) string {
	switch name {
	case "database":
		return "DATABASE_URL"
	case "broker":
		return "BROKER_URL"
	}
	return relayEnvPrefix + strings.ToUpper(strings.ReplaceAll(name, "-", "_"))
}

// relayOptions parses and checks the relay's flags and their variables,
// before anything connects.
func (c *cmd) relayOptions(args []string) (relayOptions, error) {
	o := relayOptions{}
	fs := newFlags(c.name)
	fs.StringVar(&c.database, "database", "", "`URL` of the database holding the outbox table: "+databaseURLs+" (default $DATABASE_URL)")
	fs.StringVar(&o.broker, "broker", "", "`URL` of the broker to publish to, as adapters.Open reads it: kafka://…, amqp://…, sqs://…, nats://… (default $BROKER_URL; gochannel:// and kafka:// or nats:// with no host, brokers inside this process, are refused)")
	fs.StringVar(&c.schema, "schema", sqlschema.DefaultSchema, "`NAME` of the outbox table's schema (on MySQL: its database; SQLite has none) ($"+relayEnv("schema")+")")
	fs.StringVar(&c.table, "table", sqlschema.DefaultOutboxTable, "`NAME` of the outbox table ($"+relayEnv("table")+")")
	fs.IntVar(&o.cfg.BatchSize, "batch-size", 500, "most `N` rows one batch (one transaction) publishes, 1 to 10000 ($"+relayEnv("batch-size")+")")
	fs.IntVar(&o.cfg.LanesPerBatch, "lanes-per-batch", 16, "most `N` of the table's 64 lanes one batch takes: copies running at once share the lanes, 1 to 64 ($"+relayEnv("lanes-per-batch")+")")
	fs.DurationVar(&o.cfg.PollInterval, "poll-interval", 250*time.Millisecond, "longest wait (`DURATION`) between two looks for rows while the outbox stays empty; while rows flow the relay looks again at once ($"+relayEnv("poll-interval")+")")
	fs.DurationVar(&o.cfg.DrainTimeout, "drain-timeout", 5*time.Second, "how long (`DURATION`), once told to stop, the batch in flight may take to finish publishing and deleting its rows; past it the batch rolls back and its rows stay ($"+relayEnv("drain-timeout")+")")
	fs.BoolVar(&o.cfg.LockOrderedWriters, "lock-ordered-writers", false, "the service's writers of each partition key are ordered by a lock each holds until it commits, taken before its outbox insert (the key's business row): publish every committed row at once instead of waiting until every older transaction on the server has ended, so that a transaction left open elsewhere on the server no longer stalls the outbox; see forwarder.RelayConfig.LockOrderedWriters ($"+relayEnv("lock-ordered-writers")+")")
	fs.BoolVar(&o.cfg.Ledger, "ledger", false, "record each published row in the ledger table that 'oncemill reconcile' reads, in the transaction that deletes it from the outbox (PostgreSQL, MySQL or SQLite); see forwarder.RelayConfig.Ledger ($"+relayEnv("ledger")+")")
	fs.DurationVar(&o.cfg.LedgerRetention, "ledger-retention", forwarder.DefaultLedgerRetention, "how long (`DURATION`) ledger rows are kept, at least 1m; only with --ledger ($"+relayEnv("ledger-retention")+")")
	fs.StringVar(&o.listen, "listen", defaultRelayListen, "`HOST:PORT` to serve /healthz and /metrics on; empty: no HTTP ($"+relayEnv("listen")+")")
	fs.BoolVar(&o.migrate, "migrate", false, "create or upgrade oncemill's tables (sqlschema.Migrate) before relaying; without it the outbox table must exist ($"+relayEnv("migrate")+")")
	err := onlyFlags(fs, args, "relay takes only flags")
	if err != nil {
		return o, err
	}
	if o.fromEnv, err = c.relayFromEnv(fs); err != nil {
		return o, err
	}
	switch {
	case o.broker == "":
		return o, usagef("--broker is required (or set BROKER_URL)")
	case o.cfg.BatchSize < 1 || o.cfg.BatchSize > 10000:
		return o, usagef("%s must be 1 to 10000, got %d", o.field("batch-size"), o.cfg.BatchSize)
	case o.cfg.LanesPerBatch < 1 || o.cfg.LanesPerBatch > 64:
		return o, usagef("%s must be 1 to 64, got %d", o.field("lanes-per-batch"), o.cfg.LanesPerBatch)
	case o.cfg.PollInterval < time.Millisecond:
		return o, usagef("%s must be at least 1ms, got %s", o.field("poll-interval"), o.cfg.PollInterval)
	case o.cfg.DrainTimeout <= 0:
		return o, usagef("%s must be positive, got %s", o.field("drain-timeout"), o.cfg.DrainTimeout)
	case o.cfg.LedgerRetention < time.Minute:
		return o, usagef("%s must be at least 1m, got %s", o.field("ledger-retention"), o.cfg.LedgerRetention)
	}
	if err := checkDurableBroker(o.field("broker"), o.broker, "nothing relayed"); err != nil {
		return o, err
	}
	if o.listen != "" {
		if err := checkAddr(o.field("listen"), o.listen); err != nil {
			return o, err
		}
	}
	if o.db, o.cfg.Schema, err = c.target(o.migrate); err != nil {
		return o, err
	}
	o.cfg.Schema = sqlschema.Config{Schema: o.cfg.Schema.Schema, OutboxTable: c.table}
	return o, nil
}

// relayFromEnv sets each flag the command line did not give from its
// variable, when that is set: a flag beats its variable. --database is
// left to target, which reads $DATABASE_URL for every command.
func (c *cmd) relayFromEnv(fs *flag.FlagSet) (fromEnv map[string]bool, err error) {
	given := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { given[f.Name] = true })
	fromEnv = map[string]bool{}
	fs.VisitAll(func(f *flag.Flag) {
		name := relayEnv(f.Name)
		v := c.env(name)
		if err != nil || given[f.Name] || v == "" {
			return
		}
		if f.Name == "database" {
			return // target reads $DATABASE_URL
		}
		if serr := fs.Set(f.Name, v); serr != nil {
			err = usagef("$%s=%q (--%s) is not valid: want %s", name, v, f.Name, flagWants(f, serr))
		}
		fromEnv[f.Name] = true
	})
	return fromEnv, err
}

// flagWants says what value f takes, for the error of a variable that
// set it to a value it refused with err: the kind of number or duration,
// with the default as an example, or err itself for other flags.
func flagWants(f *flag.Flag, err error) string {
	example := ""
	if f.DefValue != "" {
		example = ", like " + f.DefValue + " (the default)"
	}
	g, ok := f.Value.(flag.Getter)
	if !ok {
		return err.Error()
	}
	switch g.Get().(type) {
	case int, int64, uint, uint64:
		return "a whole number" + example
	case float64:
		return "a number" + example
	case time.Duration:
		return "a duration such as 500ms, 30s or 5m" + example
	case bool:
		return "true or false"
	}
	return err.Error()
}

// checkDurableBroker refuses, as a usage error, a broker that lives inside
// this process (adapters.CheckDurableURL): gochannel://, and kafka:// or
// nats:// with no host, which start an embedded broker. Nothing else
// subscribes to it, and what it holds is gone when the command exits, so
// the rows or entries it deletes once published would be lost. A URL that
// does not parse is left to adapters.Open to report.
// The error ends with nothing, what was not done ("nothing relayed").
func checkDurableBroker(field, broker, nothing string) error {
	if err := checkURLText(field, broker); err != nil {
		return usagef("%v; %s", err, nothing)
	}
	if err := adapters.CheckDurableURL(broker); err != nil {
		return usagef("%s: %v; %s", field, err, nothing)
	}
	return nil
}

// errNoOutbox is wrapped by the error of a relay started on a table that
// does not exist.
var errNoOutbox = errors.New("no outbox table")

// prepare migrates oncemill's tables with --migrate, and otherwise checks
// that the outbox table (and with --ledger the ledger table) exists,
// naming it when it does not.
func (o relayOptions) prepare(ctx context.Context, db database) error {
	cfg := o.cfg.Schema.WithDefaults()
	if o.migrate {
		if err := db.migrate(ctx, cfg); err != nil {
			return fmt.Errorf("migrate: %w", err)
		}
		return nil
	}
	names := sqlschema.NamesFor(db.Dialect, cfg)
	if ok, err := db.hasTable(ctx, names.Outbox); err != nil {
		return fmt.Errorf("look for the outbox table: %w", err)
	} else if !ok {
		return o.noOutbox(names.Outbox)
	}
	if !o.cfg.Ledger {
		return nil
	}
	if ok, err := db.hasTable(ctx, names.Ledger); err != nil {
		return fmt.Errorf("look for the ledger table: %w", err)
	} else if !ok {
		return o.noLedger(names.Ledger)
	}
	return nil
}

func (o relayOptions) noLedger(name string) error {
	return fmt.Errorf("the ledger table %s does not exist in the database, and %s needs it: upgrade the service's migrations "+
		"(sqlschema.Migrate, or its SQL files), or run once with --migrate", name, o.field("ledger"))
}

func (o relayOptions) noOutbox(name string) error {
	return fmt.Errorf("%w: %s does not exist in the database: create it with the service's migrations "+
		"(sqlschema.Migrate, or its SQL files), name it with --schema and --table, or run once with --migrate", errNoOutbox, name)
}

// relay runs the outbox relay until ctx is cancelled.
func (c *cmd) relay(ctx context.Context, args []string) (err error) {
	o, err := c.relayOptions(args)
	if err != nil {
		return err
	}
	// One connection for the batch, one for the probes and lag, one for
	// /healthz.
	db, err := o.db.connect(ctx, 4)
	if err != nil {
		return err
	}
	defer db.Close()
	if err := o.prepare(ctx, db); err != nil {
		return err
	}
	// One logger, for the relay's own lines and for its libraries' (the
	// forwarder, the broker's adapter): slog's text on standard error,
	// what a consumer built with oncemill writes by default (the
	// middlewares log to slog.Default()), so that one log pipeline reads
	// the consumers and their sidecar alike.
	log := slog.New(slog.NewTextHandler(c.stderr, nil))
	logger := watermill.NewSlogLogger(log)
	ps, err := openBroker(ctx, o.field("broker"), o.broker, relayGroup, "nothing relayed", logger)
	if err != nil {
		return err
	}
	defer closeBroker(ps, &err)

	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	metrics, err := prom.New(prom.Config{Registerer: reg})
	if err != nil {
		return err
	}
	cfg := o.cfg
	cfg.Pool, cfg.DB, cfg.Dialect, cfg.Publisher = db.Pool, db.DB, db.Dialect, ps.Publisher
	cfg.Hooks, cfg.Logger = []observe.Hook{metrics}, logger
	relay, err := forwarder.NewRelay(cfg)
	if err != nil {
		return err
	}

	var running atomic.Bool
	var srv *http.Server
	served := make(chan error, 1)
	if o.listen != "" {
		ln, err := net.Listen("tcp", o.listen)
		if err != nil {
			return fmt.Errorf("listen on %s (--listen): %w", o.listen, err)
		}
		mux := http.NewServeMux()
		mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
		mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, r *http.Request) {
			relayHealth(w, r, running.Load(), db)
		})
		srv = newServer(mux)
		go func() { served <- srv.Serve(ln) }()
		log.Info("oncemill relay serving /healthz and /metrics", "url", consoleURL(ln.Addr()))
	}

	outbox := o.cfg.Schema.WithDefaults()
	log.Info("oncemill relay running", "outbox", outbox.Schema+"."+outbox.OutboxTable, "broker", redact.URL(o.broker))
	running.Store(true)
	runErr := relay.Run(ctx)
	running.Store(false)

	if srv != nil {
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), relayHealthTimeout)
		defer cancel()
		if serr := srv.Shutdown(sctx); serr != nil {
			_ = srv.Close()
		}
		if serr := <-served; serr != nil && !errors.Is(serr, http.ErrServerClosed) {
			runErr = errors.Join(runErr, fmt.Errorf("serve on %s: %w", o.listen, serr))
		}
	}
	if runErr != nil {
		return runErr
	}
	log.Info("oncemill relay stopped")
	return nil
}

// relayHealth answers /healthz: 200 while the relay runs and its database
// answers a ping, 503 with the reason otherwise.
func relayHealth(w http.ResponseWriter, r *http.Request, running bool, db database) {
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	if !running {
		w.WriteHeader(http.StatusServiceUnavailable)
		fmt.Fprintln(w, "relay not running")
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), relayHealthTimeout)
	defer cancel()
	if err := db.Ping(ctx); err != nil {
		w.WriteHeader(http.StatusServiceUnavailable)
		fmt.Fprintf(w, "database unreachable: %s\n", oneLine(err.Error()))
		return
	}
	fmt.Fprintln(w, "ok")
}
