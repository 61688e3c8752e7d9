package adapters_test

import (
	"errors"
	"net/url"
	"strings"
	"testing"

	"github.com/oncemill/oncemill/adapters"
	_ "github.com/oncemill/oncemill/adapters/amqp"
	_ "github.com/oncemill/oncemill/adapters/kafka"
	_ "github.com/oncemill/oncemill/adapters/nats"
	_ "github.com/oncemill/oncemill/adapters/postgres"
	_ "github.com/oncemill/oncemill/adapters/sqs"
	"github.com/oncemill/oncemill/internal/redact"
)

// secretMark is put in every credential the fuzz target writes into a
// URL, so that finding it in an error is finding a leak.
const secretMark = "Zq9SecretMark"

// FuzzBrokerURL reads broker URLs as Open does, without connecting. For
// any text: no panic, and an error wraps ErrBadURL, ErrUnknownScheme or
// ErrNotLinked. For a URL built from fuzzed parts with a password, a
// user-only token and the value of a parameter not known to be harmless
// (password=, an unknown one) all marked: no error holds the mark.
func FuzzBrokerURL(f *testing.F) {
	for _, raw := range []string{
		"amqp://guest:guest@127.0.0.1:5672/", "amqp://:5672/", "amqp://127.0.0.1:5672/%zz",
		"127.0.0.1:5672", "localhost:9092", "kafka://127.0.0.1:1,,", "kafka://a:1,b:2?group=g",
		"kafka://?group=g&offset=middle", "nats://TOKEN@127.0.0.1:4222?group=g", "nats://?group=g&stream=S&create=true",
		"sqs://us-east-1?endpoint=http://u:p@127.0.0.1:1", "sqs://us-east-1?max_messages=11",
		"postgres://app@127.0.0.1/db?password=pw&sslmode=bogus", "gochannel://somehost:99/path",
		"gochannel://?persistent=maybe", "gochannel:opaque", "mqtt://h", "amqp://h?prefetch=-1&prefetch=2",
		"amqp://[::1", "amqp://h:port/", "%", "",
	} {
		f.Add(raw, "kafka", "user", "pw", "127.0.0.1:1", "group=g", "sasl_password", "v")
	}
	f.Add("", "amqp", "", "tok", "", "", "password", "p")
	f.Add("", "postgres", "app", "", "db:5432", "sslmode=disable", "password", "")
	f.Add("", "nats", "", "", "h:4222", "group=g&max_deliver=x", "token", "t")
	f.Add("", "sqs", "KEY", "SECRET", "us-east-1", "create=true", "endpoint", "http://u:p@h")
	f.Add("", "gochannel", "", "", "", "persistent=true", "x", "y")
	f.Fuzz(func(t *testing.T, raw, scheme, user, pw, host, query, param, value string) {
		err := adapters.CheckURL(raw, adapters.Options{})
		if err != nil && !errors.Is(err, adapters.ErrBadURL) && !errors.Is(err, adapters.ErrUnknownScheme) && !errors.Is(err, adapters.ErrNotLinked) {
			t.Fatalf("%q: error %v wraps no documented sentinel", raw, err)
		}

		if strings.Contains(scheme+user+host+query+param, secretMark[:4]) {
			return // the mark must be in credentials only
		}
		u := &url.URL{Scheme: scheme, Host: host, RawQuery: query}
		switch {
		case pw != "":
			u.User = url.UserPassword(user, secretMark+pw)
		case user != "" || host == "":
			u.User = url.User(secretMark + user)
		}
		if param != "" && !shownParam(param) {
			q := u.Query()
			q.Add(param, secretMark+value)
			u.RawQuery = query + "&" + q.Encode()
		}
		built := u.String()
		err = adapters.CheckURL(built, adapters.Options{})
		if err == nil {
			return
		}
		if !errors.Is(err, adapters.ErrBadURL) && !errors.Is(err, adapters.ErrUnknownScheme) && !errors.Is(err, adapters.ErrNotLinked) {
			t.Fatalf("%q: error %v wraps no documented sentinel", built, err)
		}
		if strings.Contains(err.Error(), secretMark) {
			t.Fatalf("%q: error leaks a credential: %v", built, err)
		}
	})
}

// shownParam reports whether the errors may print name's value: one
// known to carry no credential.
func shownParam(name string) bool {
	p := url.QueryEscape(name) + "=v"
	return redact.Query(p) == p
}

// TestBadBrokerURLs: each broker URL Open refuses before it connects, with
// the error the user reads and the sentinel it wraps; no error holds the
// password hunter2. The case names are the rows of "Bad input" in
// docs/testing.md.
func TestBadBrokerURLs(t *testing.T) {
	for _, tc := range []struct {
		name, url string
		sentinel  error
		want      string
	}{
		{"address without a scheme", "127.0.0.1:5672", adapters.ErrBadURL,
			`adapters: bad broker URL: "127.0.0.1:5672" has no scheme: write it as amqp://127.0.0.1:5672/ (the scheme names the broker: kafka://, amqp://, sqs://, nats://, postgres:// or gochannel://)`},
		{"host name and port without a scheme", "localhost:9092", adapters.ErrUnknownScheme,
			`adapters: unknown broker scheme "localhost" in "localhost:9092": it looks like host:port without a scheme; write it as kafka://localhost:9092/`},
		{"a topic name for a URL", "orders-topic", adapters.ErrUnknownScheme,
			`adapters: unknown broker scheme: "orders-topic" has no scheme; use kafka://, amqp://, sqs://, nats://, postgres:// or gochannel://`},
		{"unknown scheme", "mqtt://127.0.0.1:1883", adapters.ErrUnknownScheme,
			`adapters: unknown broker scheme "mqtt" in "mqtt://127.0.0.1:1883"; use kafka://, amqp://, sqs://, nats://, postgres:// or gochannel://`},
		{"invalid percent-escape", "amqp://guest:hunter2@127.0.0.1:5672/%zz", adapters.ErrBadURL,
			`adapters: bad broker URL: "amqp://guest:xxxxx@127.0.0.1:5672/%zz" has the invalid escape "%zz": write a literal % as %25, and other reserved characters as %XX`},
		{"empty address in a host list", "kafka://127.0.0.1:1,,", adapters.ErrBadURL,
			`adapters: bad broker URL: "kafka://127.0.0.1:1,," has an empty address in its host list: separate hosts by single commas, e.g. host1:9092,host2:9092`},
		{"port without a host", "amqp://:5672/", adapters.ErrBadURL,
			`adapters: bad broker URL: "amqp://:5672/" has a port but no host: write the host before it, e.g. amqp://127.0.0.1:5672/`},
		{"port that is not a number", "amqp://h:port/", adapters.ErrBadURL,
			`adapters: bad broker URL: "amqp://h:port/" has a port that is not a number: write host:port, e.g. 127.0.0.1:5672`},
		{"IPv6 host without its ]", "amqp://[::1", adapters.ErrBadURL,
			`adapters: bad broker URL: "amqp://[::1" has an IPv6 host without its closing ]: write it as [::1]:5672`},
		{"gochannel with a host", "gochannel://somehost:99/path", adapters.ErrBadURL,
			`adapters: open gochannel://somehost:99/path: adapters: bad broker URL: gochannel:// names host "somehost:99", but the channel lives in this process: write gochannel://?persistent=true, or the scheme of the broker at that host`},
		{"gochannel with a path", "gochannel:///path", adapters.ErrBadURL,
			`adapters: open gochannel:///path: adapters: bad broker URL: gochannel:// has a path "/path", which it does not use: remove it`},
		{"gochannel with user info", "gochannel://hunter2@", adapters.ErrBadURL,
			`adapters: open gochannel://xxxxx@: adapters: bad broker URL: gochannel:// has user info, which it does not use: remove it`},
		{"unknown parameter", "kafka://h?group=g&sasl_password=hunter2", adapters.ErrBadURL,
			`adapters: open kafka://h?group=g&sasl_password=xxxxx: adapters: bad broker URL: unknown parameter "sasl_password" for kafka://; known parameters: connect_timeout, drain_timeout, group, instance_id, max_in_flight, max_in_flight_total, offset, read_timeout, rebalance_timeout, session_timeout`},
		{"parameter given twice", "amqp://h/?group=a&group=b", adapters.ErrBadURL,
			`adapters: open amqp://h/?group=a&group=b: adapters: bad broker URL: parameter group is given 2 times`},
		{"kafka without a group", "kafka://127.0.0.1:9092", adapters.ErrBadURL,
			`adapters: open kafka://127.0.0.1:9092: adapters: bad broker URL: kafka needs a consumer group: add ?group=<name> or set Options.ConsumerGroup`},
		{"kafka offset not oldest or newest", "kafka://h:9092?group=g&offset=middle", adapters.ErrBadURL,
			`adapters: open kafka://h:9092?group=g&offset=middle: adapters: bad broker URL: parameter offset="middle": use oldest or newest`},
		{"nats ack_wait under 1s", "nats://h?group=g&ack_wait=1ms", adapters.ErrBadURL,
			`adapters: open nats://h?group=g&ack_wait=1ms: adapters: bad broker URL: parameter ack_wait=1ms: want at least 1s, as the subscription sends a heartbeat every third of it`},
		{"nats stream with create", "nats://h?group=g&stream=S&create=true", adapters.ErrBadURL,
			`adapters: open nats://h?group=g&stream=S&create=true: adapters: bad broker URL: parameters stream=S and create=true: create makes a stream per topic; a stream named by stream= must exist with the subjects it holds`},
		{"sqs max_messages over 10", "sqs://us-east-1?max_messages=11", adapters.ErrBadURL,
			`adapters: open sqs://us-east-1?max_messages=11: adapters: bad broker URL: parameter max_messages="11": want an integer from 1 to 10, the messages one receive asks for`},
		{"amqp prefetch not a number", "amqp://h/?prefetch=abc", adapters.ErrBadURL,
			`adapters: open amqp://h/?prefetch=abc: adapters: bad broker URL: parameter prefetch="abc" is not an integer`},
		{"connect_timeout not positive", "gochannel://?connect_timeout=-1s", adapters.ErrBadURL,
			`adapters: open gochannel://?connect_timeout=-1s: adapters: bad broker URL: parameter connect_timeout="-1s": want a positive Go duration such as 5s, or whole seconds`},
		{"postgres sslmode not known", "postgres://app:hunter2@127.0.0.1/db?sslmode=bogus", adapters.ErrBadURL,
			"adapters: open postgres://app:xxxxx@127.0.0.1/db?sslmode=bogus: adapters: bad broker URL: cannot parse `postgres://app:xxxxx@127.0.0.1/db?sslmode=bogus`: failed to configure TLS (sslmode is invalid)"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := adapters.CheckURL(tc.url, adapters.Options{})
			if err == nil {
				t.Fatalf("%s accepted", tc.url)
			}
			if got := err.Error(); got != tc.want {
				t.Fatalf("error\n got %s\nwant %s", got, tc.want)
			}
			if !errors.Is(err, tc.sentinel) {
				t.Fatalf("error %v does not wrap %v", err, tc.sentinel)
			}
			if strings.Contains(err.Error(), "hunter2") {
				t.Fatalf("error holds the password: %v", err)
			}
		})
	}
}
