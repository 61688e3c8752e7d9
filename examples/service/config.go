package main

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/url"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/oncemill/oncemill/sqlschema"
)

// config is everything the service reads from its environment.
type config struct {
	// DatabaseURL is the PostgreSQL holding the inbox, the outbox, the
	// dead-letter table and the payments (DATABASE_URL).
	DatabaseURL string
	// BrokerURL chooses the broker (BROKER_URL), see adapters.Open.
	BrokerURL string
	// HTTPAddr serves /metrics and /healthz (HTTP_ADDR).
	HTTPAddr string
	// Schema is the PostgreSQL schema of oncemill's tables and of the
	// payments table (DB_SCHEMA).
	Schema string
	// Topic is consumed (TOPIC); EventsTopic receives one event per
	// payment recorded, through the outbox (EVENTS_TOPIC). Dead letters
	// are written to the dead-letter table under Topic + ".dlq".
	Topic, EventsTopic string
	// ConsumerGroup is the broker's consumer group (CONSUMER_GROUP). It is
	// left empty when BROKER_URL names a group itself and CONSUMER_GROUP
	// is not set.
	ConsumerGroup string
	// LogLevel is the slog level (LOG_LEVEL): debug shows a line per
	// duplicate dropped and per message handled.
	LogLevel slog.Level
	// TracesEndpoint is the URL the spans are exported to with OTLP over
	// HTTP: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT as it is, else
	// OTEL_EXPORTER_OTLP_ENDPOINT followed by /v1/traces, the variables
	// of the OpenTelemetry specification. Empty, when neither is set or
	// OTEL_SDK_DISABLED is true: the service traces nothing and adds no
	// tracing hook. The exporter and the SDK read their other OTEL_*
	// variables themselves (OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES,
	// OTEL_TRACES_SAMPLER, OTEL_EXPORTER_OTLP_HEADERS, OTEL_BSP_*, …).
	// It may hold a password: log it redacted.
	TracesEndpoint string
}

// The defaults: a local PostgreSQL and an in-process broker, so that
// `go run ./examples/service` works on one machine with nothing else.
const (
	defaultDatabaseURL = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"
	defaultBrokerURL   = "gochannel://"
	defaultHTTPAddr    = "127.0.0.1:8081"
)

// loadConfig reads the configuration through getenv (os.Getenv) and checks
// it. Every problem is reported, each naming its variable.
func loadConfig(getenv func(string) string) (config, error) {
	get := func(name, def string) string {
		if v := getenv(name); v != "" {
			return v
		}
		return def
	}
	c := config{
		DatabaseURL:   get("DATABASE_URL", defaultDatabaseURL),
		BrokerURL:     get("BROKER_URL", defaultBrokerURL),
		HTTPAddr:      get("HTTP_ADDR", defaultHTTPAddr),
		Schema:        get("DB_SCHEMA", sqlschema.DefaultSchema),
		Topic:         get("TOPIC", "orders"),
		EventsTopic:   get("EVENTS_TOPIC", "payments.recorded"),
		ConsumerGroup: get("CONSUMER_GROUP", "payments"),
	}
	var errs []error
	bad := func(name, format string, args ...any) {
		errs = append(errs, fmt.Errorf("%s: "+format, append([]any{name}, args...)...))
	}

	if _, err := pgxpool.ParseConfig(c.DatabaseURL); err != nil {
		// pgx leaves the password out of its parse errors.
		bad("DATABASE_URL", "%v", err)
	}

	if u, err := url.Parse(c.BrokerURL); err != nil {
		bad("BROKER_URL", "not a URL") // url.Parse's error would repeat the password
	} else {
		switch u.Scheme {
		case "gochannel", "kafka", "amqp", "amqps", "sqs", "postgres", "postgresql":
		default:
			bad("BROKER_URL", "scheme %q is not one of gochannel, kafka, amqp, amqps, sqs, postgres", u.Scheme)
		}
		if u.Query().Get("group") != "" && getenv("CONSUMER_GROUP") == "" {
			c.ConsumerGroup = "" // the URL names the group: passing ours too would contradict it
		}
	}

	if _, port, err := net.SplitHostPort(c.HTTPAddr); err != nil {
		bad("HTTP_ADDR", "want host:port, such as 127.0.0.1:8081 or :8081: %v", err)
	} else if p, err := strconv.Atoi(port); err != nil || p < 0 || p > 65535 {
		bad("HTTP_ADDR", "port %q is not a number from 0 to 65535", port)
	}

	if sqlschema.ValidateIdentifier("DB_SCHEMA", c.Schema) != nil {
		bad("DB_SCHEMA", "%q is not a valid schema name: use 1 to 48 characters of a-z, 0-9 and _, not starting with a digit", c.Schema)
	}

	switch {
	case c.Topic == c.EventsTopic:
		bad("EVENTS_TOPIC", "must differ from TOPIC (%q): the service would consume its own events", c.Topic)
	case c.Topic+".dlq" == c.EventsTopic:
		bad("EVENTS_TOPIC", "%q is the dead-letter topic of TOPIC", c.EventsTopic)
	}

	if lvl := getenv("LOG_LEVEL"); lvl != "" {
		if err := c.LogLevel.UnmarshalText([]byte(lvl)); err != nil {
			bad("LOG_LEVEL", "want debug, info, warn or error, got %q", lvl)
		}
	}

	c.TracesEndpoint = tracesEndpoint(getenv, bad)
	return c, errors.Join(errs...)
}

// tracesEndpoint returns where the spans go, as the OTLP/HTTP exporter
// reads it from the environment, or "" for no tracing; bad reports a
// value the exporter would not use. The exporter, given a URL it cannot
// use, logs it and sends to https://localhost:4318 instead: refusing to
// start names the variable instead.
func tracesEndpoint(getenv func(string) string, bad func(name, format string, args ...any)) string {
	if disabled := getenv("OTEL_SDK_DISABLED"); disabled != "" {
		if off, err := strconv.ParseBool(disabled); err != nil {
			bad("OTEL_SDK_DISABLED", "want true or false, got %q", disabled)
		} else if off {
			return ""
		}
	}
	endpoint := ""
	for _, v := range []struct{ name, path string }{
		// The per-signal URL is used as it is and wins over the base URL.
		{"OTEL_EXPORTER_OTLP_ENDPOINT", "/v1/traces"},
		{"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", ""},
	} {
		raw := getenv(v.name)
		if raw == "" {
			continue
		}
		// url.Parse's error and the value would repeat a password.
		u, err := url.Parse(raw)
		if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			bad(v.name, "want an http:// or https:// URL with a host, such as http://127.0.0.1:4318")
			continue
		}
		if v.path != "" {
			u.Path = strings.TrimSuffix(u.Path, "/") + v.path
		}
		endpoint = u.String()
	}
	if endpoint == "" {
		return ""
	}
	for _, name := range []string{"OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"} {
		switch p := getenv(name); p {
		case "", "http/protobuf", "http/json":
		default:
			bad(name, "the service exports over HTTP: want http/protobuf (the default) or http/json, got %q", p)
		}
	}
	return endpoint
}

// schema names oncemill's tables: the migrator, the inbox store, the
// outbox and the dead-letter table all take this one value.
func (c config) schema() sqlschema.Config { return sqlschema.Config{Schema: c.Schema} }

// dlqTopic is the topic dead letters are filed under in the dead-letter
// table (`oncemill dlq list --topic` shows the original topic instead).
func (c config) dlqTopic() string { return c.Topic + ".dlq" }

// redacted returns rawURL without its password, for logs.
func redacted(rawURL string) string {
	u, err := url.Parse(rawURL)
	if err != nil {
		return "(unparsable)"
	}
	return u.Redacted()
}
