package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"strings"
	"time"
	"unicode"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/oncemill/oncemill/console"
	"github.com/oncemill/oncemill/dlq"
	"github.com/oncemill/oncemill/reconcile"
	"github.com/oncemill/oncemill/sqlschema"
)

const (
	// defaultConsoleAddr is where the console listens without --addr: the
	// loopback interface only.
	defaultConsoleAddr = "127.0.0.1:8080"
	// consoleTokenEnv names the token when --token is not given.
	consoleTokenEnv = "ONCEMILL_CONSOLE_TOKEN"
	// minTokenLength is the shortest token accepted: the token is the
	// console's only lock.
	minTokenLength = console.MinTokenLength
	// consoleShutdownTimeout bounds the graceful shutdown: requests in
	// flight get this long to finish once the command is told to stop.
	consoleShutdownTimeout = 10 * time.Second
)

// consoleOptions is "oncemill console"'s command line, checked.
type consoleOptions struct {
	addr     string
	token    string
	minted   bool // token generated here: printed once at start
	readOnly bool
	broker   string
	inbox    *inboxTarget // nil without --inbox
	db       *dbURL
	schema   sqlschema.Config
	// reconcile are the overview's checks, from --reconcile.
	reconcile []reconcile.Config
}

// consoleOptions parses and checks the console's flags, before anything
// connects.
func (c *cmd) consoleOptions(args []string) (consoleOptions, error) {
	o := consoleOptions{}
	var inboxTable, outboxTable, retryTable, inboxURL string
	fs := newFlags(c.name)
	fs.StringVar(&o.addr, "addr", defaultConsoleAddr, "`HOST:PORT` to listen on")
	fs.StringVar(&o.token, "token", "", "access `TOKEN`, at least 16 characters (default $"+consoleTokenEnv+", which stays out of the process list; without either, one is generated and printed once)")
	fs.BoolVar(&o.readOnly, "read-only", false, "hide and refuse replays, purges, retries and cancels")
	fs.StringVar(&o.broker, "broker", "", "`URL` of a broker through which to offer replays to the original topic too (never $BROKER_URL; gochannel:// and kafka:// or nats:// with no host are refused); without it a replay goes only to the entry's consumer, through the dlq.ReplaySubscriber it runs")
	fs.StringVar(&inboxURL, "inbox", "", "`URL` of the consumers' inbox store, where replays to the topic write their grants, as for dlq replay (needs --broker)")
	fs.StringVar(&c.database, "database", "", "`URL` of the database holding oncemill's tables: "+databaseURLs+" (default $DATABASE_URL)")
	fs.StringVar(&c.schema, "schema", sqlschema.DefaultSchema, "`NAME` of the schema of oncemill's tables (on MySQL: their database; SQLite has none)")
	fs.StringVar(&c.table, "table", sqlschema.DefaultDLQTable, "`NAME` of the dead-letter table")
	fs.StringVar(&inboxTable, "inbox-table", sqlschema.DefaultInboxTable, "`NAME` of the inbox table")
	fs.StringVar(&outboxTable, "outbox-table", sqlschema.DefaultOutboxTable, "`NAME` of the outbox table")
	fs.StringVar(&retryTable, "retry-table", sqlschema.DefaultRetryTable, "`NAME` of the table of parked messages, waiting for a delayed retry")
	fs.Func("reconcile", "`CONSUMER[=TOPIC,…]` whose inbox the overview checks against the relay's ledger, on the topics it reads (default every topic), as 'oncemill reconcile' does; repeated for each consumer", func(s string) error {
		consumer, topics, hasTopics := strings.Cut(s, "=")
		rc := reconcile.Config{Consumer: strings.TrimSpace(consumer)}
		if rc.Consumer == "" {
			return fmt.Errorf("%q names no consumer: want CONSUMER or CONSUMER=TOPIC,TOPIC", s)
		}
		var err error
		if hasTopics {
			rc.Topics, err = splitTopics(s, topics)
		}
		o.reconcile = append(o.reconcile, rc)
		return err
	})
	grace, since := reconcile.DefaultGrace, reconcile.DefaultSince
	parsedFlag(fs, "reconcile-grace", "`DURATION` an event may take from its publish to its consumer's commit: younger events are not checked (default 5m)", &grace, parseAgo)
	parsedFlag(fs, "reconcile-since", "`DURATION` back from now that the overview's checks read (default 24h); each page load reads it, so keep it short on a busy ledger", &since, parseAgo)
	if err := onlyFlags(fs, args, "console takes only flags"); err != nil {
		return o, err
	}
	if err := checkAddr("--addr", o.addr); err != nil {
		return o, err
	}
	if since <= grace {
		return o, usagef("--reconcile-since (%s) must be longer than --reconcile-grace (%s): nothing would be checked", since, grace)
	}
	for i := range o.reconcile {
		o.reconcile[i].Grace, o.reconcile[i].Since = grace, since
	}
	if o.broker != "" {
		if o.readOnly {
			return o, usagef("--read-only replays nothing: drop --broker")
		}
		if err := checkDurableBroker("--broker", o.broker, "the console did not start"); err != nil {
			return o, err
		}
	}
	var err error
	if inboxURL != "" {
		if o.broker == "" {
			return o, usagef("--inbox is where replays to the topic write their grants: give --broker too")
		}
		if o.inbox, err = parseInbox(inboxURL); err != nil {
			return o, err
		}
	}
	if o.token == "" {
		o.token = c.env(consoleTokenEnv)
	}
	if o.token == "" {
		if o.token, err = newToken(); err != nil {
			return o, err
		}
		o.minted = true
	} else if err := checkToken(o.token); err != nil {
		return o, err
	}
	if err := checkNames("--inbox-table", inboxTable, "--outbox-table", outboxTable, "--retry-table", retryTable); err != nil {
		return o, err
	}
	if o.db, o.schema, err = c.target(false); err != nil {
		return o, err
	}
	o.schema.InboxTable = inboxTable
	o.schema.OutboxTable = outboxTable
	o.schema.RetryTable = retryTable
	return o, nil
}

// checkAddr refuses, as a usage error naming field, an address to listen
// on that is not host:port with a numeric port.
func checkAddr(field, addr string) error {
	_, port, err := net.SplitHostPort(addr)
	if err != nil {
		return usagef("%s %q is not host:port (like 127.0.0.1:8080): %v", field, addr, err)
	}
	if n, err := strconv.Atoi(port); err != nil || n < 0 || n > 65535 {
		return usagef("%s %q: port %q is not a number from 0 to 65535", field, addr, port)
	}
	return nil
}

// checkToken refuses, as a usage error, a token that is too short to
// guard the console or that an Authorization header cannot carry.
func checkToken(token string) error {
	if len(token) < minTokenLength {
		return usagef("--token (or $%s) must be at least %d characters, got %d", consoleTokenEnv, minTokenLength, len(token))
	}
	if i := strings.IndexFunc(token, func(r rune) bool { return unicode.IsSpace(r) || unicode.IsControl(r) || r > unicode.MaxASCII }); i >= 0 {
		return usagef("--token (or $%s) must be printable ASCII without spaces", consoleTokenEnv)
	}
	return nil
}

// newToken returns 32 random bytes in hex.
func newToken() (string, error) {
	var b [32]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", fmt.Errorf("generate a console token: %w", err)
	}
	return hex.EncodeToString(b[:]), nil
}

// config is the console's configuration for the options, the database
// and the publisher (nil without --broker).
func (o consoleOptions) config(db database, pub message.Publisher, granter dlq.Granter, logger watermill.LoggerAdapter) console.Config {
	return console.Config{
		Pool:      db.Pool,
		DB:        db.DB,
		Dialect:   db.Dialect,
		Schema:    o.schema,
		Token:     o.token,
		ReadOnly:  o.readOnly,
		Publisher: pub,
		Granter:   granter,
		Reconcile: o.reconcile,
		Logger:    logger,
	}
}

// serveConsole serves the operator console on --addr until ctx is
// cancelled, then shuts the server down gracefully and closes the broker
// and the database.
func (c *cmd) serveConsole(ctx context.Context, args []string) (err error) {
	o, err := c.consoleOptions(args)
	if err != nil {
		return err
	}
	db, err := o.db.connect(ctx, 8)
	if err != nil {
		return err
	}
	defer db.Close()
	logger := watermill.NewStdLoggerWithOut(c.stderr, false, false)

	var pub message.Publisher
	if o.broker != "" {
		ps, err := openBroker(ctx, "--broker", o.broker, "oncemill-console", "the console did not start", logger)
		if err != nil {
			return err
		}
		defer closeBroker(ps, &err)
		pub = ps.Publisher
	}
	var granter dlq.Granter
	if o.inbox != nil {
		g, closeInbox, err := o.inbox.open(ctx)
		if err != nil {
			return err
		}
		defer closeInbox()
		granter = g
	}

	handler, err := console.New(o.config(db, pub, granter, logger))
	if err != nil {
		return err
	}
	ln, err := net.Listen("tcp", o.addr)
	if err != nil {
		return fmt.Errorf("listen on %s: %w", o.addr, err)
	}
	srv := newServer(handler)
	base := consoleURL(ln.Addr())
	c.announce(o, base, ln.Addr())

	served := make(chan error, 1)
	go func() { served <- srv.Serve(ln) }()
	select {
	case err := <-served:
		// Serve returns only on a failure of the listener.
		return fmt.Errorf("serve on %s: %w", ln.Addr(), err)
	case <-ctx.Done():
	}
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), consoleShutdownTimeout)
	defer cancel()
	if err := srv.Shutdown(sctx); err != nil {
		// Requests still running after the timeout are cut off.
		_ = srv.Close()
		<-served
		return fmt.Errorf("shut down: %w", err)
	}
	<-served
	fmt.Fprintln(c.stdout, "oncemill console stopped")
	return nil
}

// newServer is the HTTP server of the console and of the relay's probes,
// with its timeouts.
func newServer(h http.Handler) *http.Server {
	return &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second, IdleTimeout: 2 * time.Minute}
}

// consoleURL is the address to open in a browser for the listener's
// address: an unspecified address (all interfaces) is reached as
// localhost.
func consoleURL(addr net.Addr) string {
	host, port, err := net.SplitHostPort(addr.String())
	if err != nil {
		return "http://" + addr.String() + "/"
	}
	if ip := net.ParseIP(host); ip != nil && ip.IsUnspecified() {
		host = "localhost"
	}
	return "http://" + net.JoinHostPort(host, port) + "/"
}

// announce prints where the console listens and, when it generated the
// token, the token: the only time it is shown. Serving beyond the loopback
// interface is plain HTTP, which a warning on stderr points out.
func (c *cmd) announce(o consoleOptions, base string, addr net.Addr) {
	mode := ""
	if o.readOnly {
		mode = " (read-only)"
	}
	fmt.Fprintf(c.stdout, "oncemill console listening on %s%s\n", base, mode)
	if o.minted {
		fmt.Fprintf(c.stdout, "console token: %s\n", o.token)
		fmt.Fprintf(c.stdout, "open %slogin and enter the token (set --token or $%s to choose one)\n", base, consoleTokenEnv)
	}
	if tcp, ok := addr.(*net.TCPAddr); ok && !tcp.IP.IsLoopback() {
		fmt.Fprintf(c.stderr, "%s: warning: serving plain HTTP on %s: the token and the pages cross the network unencrypted; put the console behind a TLS proxy, or listen on 127.0.0.1\n", c.name, addr)
	}
}
