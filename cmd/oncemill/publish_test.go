package main

import (
	"bytes"
	"context"
	"fmt"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/adapters"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
)

// publishWith runs "oncemill publish args…" in-process with stdin as its
// standard input.
func publishWith(t *testing.T, env map[string]string, stdin string, args ...string) result {
	t.Helper()
	var out, errOut bytes.Buffer
	x := &cmd{
		name:   "oncemill publish",
		env:    func(k string) string { return env[k] },
		stdout: &out,
		stderr: &errOut,
		stdin:  strings.NewReader(stdin),
		now:    time.Now(),
	}
	code := exit(x.name, lookup("publish").run(x, context.Background(), args), &errOut)
	return result{code: code, stdout: out.String(), stderr: errOut.String()}
}

// subscribed opens brokerURL as consumer group "billing" would, subscribes
// to topic (declaring its queue on RabbitMQ) and returns the deliveries.
func subscribed(t *testing.T, brokerURL, topic string) <-chan *message.Message {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	ps, err := adapters.Open(ctx, brokerURL, adapters.Options{ConsumerGroup: "billing"})
	require.NoError(t, err)
	msgs, err := ps.Subscriber.Subscribe(ctx, topic)
	require.NoError(t, err)
	t.Cleanup(func() {
		cancel()
		require.NoError(t, ps.Close())
	})
	return msgs
}

// received takes n messages from msgs, acking each, in order.
func received(t *testing.T, msgs <-chan *message.Message, n int) []*message.Message {
	t.Helper()
	var got []*message.Message
	timeout := time.After(30 * time.Second)
	for len(got) < n {
		select {
		case m := <-msgs:
			m.Ack()
			got = append(got, m)
		case <-timeout:
			t.Fatalf("received %d of %d messages in 30s", len(got), n)
		}
	}
	return got
}

// publishBrokers are the brokers publish is tested on from outside:
// RabbitMQ, and PostgreSQL as the broker, as the README's consumer runs in
// its test.
func publishBrokers(t *testing.T) map[string]func(t *testing.T) (brokerURL, topic string) {
	return map[string]func(t *testing.T) (string, string){
		"rabbitmq": func(t *testing.T) (string, string) {
			rb := newRabbit(t)
			return rb.url, rb.topic("publish", "$.billing")
		},
		"postgres": func(t *testing.T) (string, string) {
			schema := pgtest.Schema(t, pgtest.Pool(t, 2))
			u, err := url.Parse(pgtest.URL())
			require.NoError(t, err)
			q := u.Query()
			q.Set("search_path", schema)
			u.RawQuery = q.Encode()
			return u.String(), "orders"
		},
	}
}

// A message published from arguments arrives with the UUID, key,
// partition key and metadata given, its payload byte for byte; a second
// argument is a second message with a new UUID and the same key.
func TestPublishArguments(t *testing.T) {
	t.Parallel()
	for name, open := range publishBrokers(t) {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			brokerURL, topic := open(t)
			msgs := subscribed(t, brokerURL, topic)

			const id = "0f3c2a36-6a53-4d4e-9a2f-6f2b9bb1c001"
			r := oncemill(t, map[string]string{"BROKER_URL": brokerURL}, "publish", "--topic", topic,
				"--uuid", id, "--key", "A-42", "--partition-key", "customer-7", "--meta", "source=cli", "--meta", "trace=a=b",
				`{"orderId":"A-42","amountCents":1999}`)
			require.Equal(t, exitOK, r.code, r.stderr)
			require.Equal(t, "sent "+id+" key A-42\n", r.stdout)
			r = oncemill(t, nil, "publish", "--broker", brokerURL, "--topic", topic, "--key", "A-42", "first", "second")
			require.Equal(t, exitOK, r.code, r.stderr)
			lines := strings.Split(strings.TrimSuffix(r.stdout, "\n"), "\n")
			require.Len(t, lines, 2, r.stdout)

			got := received(t, msgs, 3)
			require.Equal(t, id, got[0].UUID)
			require.Equal(t, `{"orderId":"A-42","amountCents":1999}`, string(got[0].Payload))
			require.Equal(t, "A-42", got[0].Metadata.Get(delivery.IdempotencyKey))
			require.Equal(t, "customer-7", got[0].Metadata.Get(delivery.PartitionKey))
			require.Equal(t, "cli", got[0].Metadata.Get("source"))
			require.Equal(t, "a=b", got[0].Metadata.Get("trace"))
			for i, want := range []string{"first", "second"} {
				m := got[i+1]
				require.Equal(t, want, string(m.Payload))
				require.Equal(t, "A-42", m.Metadata.Get(delivery.IdempotencyKey))
				require.Equal(t, "sent "+m.UUID+" key A-42", lines[i])
				require.NotEqual(t, id, m.UUID)
			}
			require.NotEqual(t, got[1].UUID, got[2].UUID)
		})
	}
}

// Lines on standard input: a JSON payload is sent as its JSON, a string as
// its text; a line's fields win over the flags, which fill what a line
// does not set.
func TestPublishLines(t *testing.T) {
	t.Parallel()
	for name, open := range publishBrokers(t) {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			brokerURL, topic := open(t)
			msgs := subscribed(t, brokerURL, topic)

			const id = "6d1f1e5e-2b7f-4a55-8f5e-3c5a5e0b7d02"
			stdin := `{"uuid":"` + id + `","key":"A-42","partition_key":"c-1","metadata":{"source":"line"},"payload":{"orderId": "A-42", "amountCents": 1999}}

{"payload":"PAYMENT OK A-42"}
`
			r := publishWith(t, nil, stdin, "--broker", brokerURL, "--topic", topic, "--key", "fallback", "--meta", "source=flag", "--meta", "env=test")
			require.Equal(t, exitOK, r.code, r.stderr)
			got := received(t, msgs, 2)
			require.Equal(t, fmt.Sprintf("sent %s key A-42\nsent %s key fallback\n", id, got[1].UUID), r.stdout)

			require.Equal(t, id, got[0].UUID)
			require.Equal(t, `{"orderId":"A-42","amountCents":1999}`, string(got[0].Payload))
			require.Equal(t, "A-42", got[0].Metadata.Get(delivery.IdempotencyKey))
			require.Equal(t, "c-1", got[0].Metadata.Get(delivery.PartitionKey))
			require.Equal(t, "line", got[0].Metadata.Get("source"))
			require.Equal(t, "test", got[0].Metadata.Get("env"))

			require.Equal(t, "PAYMENT OK A-42", string(got[1].Payload))
			require.Equal(t, "fallback", got[1].Metadata.Get(delivery.IdempotencyKey))
			require.Equal(t, "flag", got[1].Metadata.Get("source"))
		})
	}
}

// A bad line is named by its number and field, and nothing is sent, not
// even the good lines before it: the queue stays empty.
func TestPublishBadLineSendsNothing(t *testing.T) {
	t.Parallel()
	rb := newRabbit(t)
	topic := rb.topic("publish-bad", "$.billing")
	subscribed(t, rb.url, topic)
	good := `{"payload":{"orderId":"A-42"}}` + "\n"
	for _, c := range []struct{ stdin, want string }{
		{good + `{"payload":"x","metadata":{"n":1}}`, `standard input, line 2: field "metadata": want an object of string values, got a JSON number; nothing sent`},
		{good + good + `{"uuid":7,"payload":"x"}`, `standard input, line 3: field "uuid": want a string, got a JSON number; nothing sent`},
		{good + `{"key":"A-42"}`, `standard input, line 2: field "payload" is missing: give the message's body as a JSON string or value; nothing sent`},
		{good + `{"body":"x","payload":"x"}`, `standard input, line 2: unknown field "body": the fields are uuid, key, partition_key, metadata, payload; nothing sent`},
		{`PAYMENT OK`, `standard input, line 1: not a JSON object: invalid character 'P' looking for beginning of value; nothing sent`},
		{`{"payload":"x","metadata":{"idempotency_key":"k"}}`, `standard input, line 1: field "metadata": idempotency_key: give it as the field "key"; nothing sent`},
		{"\n\n", `no PAYLOAD argument and no message on standard input; nothing sent`},
	} {
		r := publishWith(t, nil, c.stdin, "--broker", rb.url, "--topic", topic)
		require.Equal(t, exitUsage, r.code, r.stderr)
		require.Equal(t, "oncemill publish: "+c.want+"; run 'oncemill publish --help' for usage\n", r.stderr)
		require.Empty(t, r.stdout)
	}
	require.Equal(t, 0, rb.ready(topic+".billing"), "nothing sent")
}

func TestPublishUsageErrors(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		args []string
		env  map[string]string
		want string
	}{
		{[]string{"--broker", "amqp://127.0.0.1:1/", "x"}, nil, "--topic is required"},
		{[]string{"--topic", "t", "x"}, nil, "--broker is required (or set BROKER_URL)"},
		{[]string{"--topic", "t", "x"}, map[string]string{"BROKER_URL": "gochannel://"}, "--broker: adapters: not a durable destination: gochannel:// lives inside this process"},
		{[]string{"--topic", "t", "--broker", "kafka://", "x"}, nil, "--broker: adapters: not a durable destination"},
		{[]string{"--topic", "t", "--broker", "amqp://127.0.0.1:1/", "--uuid", "u", "x", "y"}, nil, "--uuid names one message: give exactly one PAYLOAD argument"},
		{[]string{"--topic", "t", "--broker", "amqp://127.0.0.1:1/", "--meta", "novalue", "x"}, nil, `invalid value "novalue" for flag -meta: "novalue" is not NAME=VALUE`},
		{[]string{"--topic", "t", "--broker", "amqp://127.0.0.1:1/", "--meta", "idempotency_key=k", "x"}, nil, "--meta idempotency_key: give it with --key"},
		{[]string{"--topic", "t", "--broker", "amqp://127.0.0.1:1/", "--meta", "a=1", "--meta", "a=2", "x"}, nil, `"a" is given twice`},
		{[]string{"--topic", "t", "--broker", "nope://x", "x"}, nil, "--broker: "},
	} {
		r := oncemill(t, c.env, append([]string{"publish"}, c.args...)...)
		require.Equal(t, exitUsage, r.code, "%v: %s", c.args, r.stderr)
		require.Contains(t, r.stderr, c.want, c.args)
		requireOneLine(t, r.stderr)
	}
}

// A publish the broker refuses stops the command and says what was sent:
// on RabbitMQ, a topic no queue is bound to, which a plain publish would
// lose.
func TestPublishUnroutable(t *testing.T) {
	t.Parallel()
	rb := newRabbit(t)
	topic := rb.topic("publish-unbound")
	r := oncemill(t, nil, "publish", "--broker", rb.url, "--topic", topic, "--key", "A-42", "one", "two")
	require.Equal(t, exitFailure, r.code, r.stderr)
	require.Empty(t, r.stdout)
	require.Contains(t, r.stderr, "oncemill publish: sent 0 of 2 messages, then argument 1 (uuid ")
	require.Contains(t, r.stderr, "amqp: message unroutable")
	requireOneLine(t, r.stderr)
}
