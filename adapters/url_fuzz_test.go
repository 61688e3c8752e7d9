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
