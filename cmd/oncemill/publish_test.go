package main

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"net/url"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync/atomic"
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
	return publishFrom(t, env, strings.NewReader(stdin), args...)
}

// publishFrom runs "oncemill publish args…" in-process with stdin as its
// standard input.
func publishFrom(t *testing.T, env map[string]string, stdin io.Reader, args ...string) result {
	t.Helper()
	var out, errOut bytes.Buffer
	x := &cmd{
		name:   "oncemill publish",
		env:    func(k string) string { return env[k] },
		stdout: &out,
		stderr: &errOut,
		stdin:  stdin,
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
	// The hint names the consumers' group to declare, not a queue of
	// publish's own that no consumer would read and every message fill.
	require.Contains(t, r.stderr, "oncemill amqp declare --topic "+topic+" --group GROUP")
	require.NotContains(t, r.stderr, "oncemill-publish")
}

// A line that the JSON decoders would read some other way than it says,
// silently, is refused with its number, and nothing is sent: a field or
// a metadata name given twice (the last one would win), an empty key or
// partition_key beside the flag that fills the lines without one (the
// flag's value would be sent), a byte that is not UTF-8 and half of a
// UTF-16 surrogate pair (each would be sent as U+FFFD). A line longer
// than the limit after blank lines is named by its own number. The same
// from a file, read twice, and from a pipe, copied aside while checked.
func TestPublishRefusesWhatItWouldGuess(t *testing.T) {
	t.Parallel()
	rb := newRabbit(t)
	topic := rb.topic("publish-guess", "$.billing")
	msgs := subscribed(t, rb.url, topic)
	good := `{"payload":{"orderId":"A-42"}}` + "\n"
	for _, c := range []struct {
		name, stdin, want string
		args              []string
	}{
		{name: "field given twice", stdin: good + `{"key":"A-42","key":"A-43","payload":"x"}`,
			want: `standard input, line 2: field "key" is given twice: give each field once`},
		{name: "metadata name given twice", stdin: good + `{"payload":"x","metadata":{"source":"a","source":"b"}}`,
			want: `standard input, line 2: field "metadata": "source" is given twice: give each name once`},
		{name: "empty key beside --key", stdin: `{"key":"","payload":"x"}`, args: []string{"--key", "fallback"},
			want: `standard input, line 1: field "key" is empty: leave it out to take --key ("fallback"), or give one`},
		{name: "empty key", stdin: `{"key":"","payload":"x"}`,
			want: `standard input, line 1: field "key" is empty: leave it out for a message without one, or give one`},
		{name: "empty partition_key beside --partition-key", stdin: `{"partition_key":"","payload":"x"}`, args: []string{"--partition-key", "c-1"},
			want: `standard input, line 1: field "partition_key" is empty: leave it out to take --partition-key ("c-1"), or give one`},
		{name: "invalid UTF-8", stdin: good + "{\"payload\":\"caf\xe9\"}",
			want: `standard input, line 2: byte 16 is not UTF-8: a line is JSON text in UTF-8; send a payload that is not text as a PAYLOAD argument`},
		{name: "lone high surrogate", stdin: good + `{"payload":"order \ud83d A-42"}`,
			want: `standard input, line 2: field "payload": \ud83d is half of a UTF-16 surrogate pair, which no UTF-8 text can hold: give the pair, or the character as UTF-8`},
		{name: "lone low surrogate in an object", stdin: `{"payload":{"note":"\udc00"}}`,
			want: `standard input, line 1: field "payload": \udc00 is half of a UTF-16 surrogate pair, which no UTF-8 text can hold: give the pair, or the character as UTF-8`},
		{name: "lone surrogate in metadata", stdin: `{"payload":"x","metadata":{"who":"\uDBFF"}}`,
			want: `standard input, line 1: field "metadata": \uDBFF is half of a UTF-16 surrogate pair, which no UTF-8 text can hold: give the pair, or the character as UTF-8`},
		{name: "long line after blank lines", stdin: "\n\n" + good + "\n" + `{"payload":"` + strings.Repeat("x", maxPublishLine) + `"}`,
			want: `standard input, line 5: longer than 16 MiB`},
	} {
		for from, reader := range map[string]func(string) io.Reader{
			"file": func(s string) io.Reader { return strings.NewReader(s) },
			"pipe": func(s string) io.Reader { return struct{ io.Reader }{strings.NewReader(s)} },
		} {
			r := publishFrom(t, nil, reader(c.stdin), append([]string{"--broker", rb.url, "--topic", topic}, c.args...)...)
			require.Equal(t, exitUsage, r.code, "%s from a %s: %s", c.name, from, r.stderr)
			require.Equal(t, "oncemill publish: "+c.want+"; nothing sent; run 'oncemill publish --help' for usage\n", r.stderr, "%s from a %s", c.name, from)
			require.Empty(t, r.stdout)
		}
	}

	// A pair is a character, which arrives as UTF-8; it is the first
	// message the queue got.
	r := publishFrom(t, nil, struct{ io.Reader }{strings.NewReader(`{"payload":"order \ud83d\ude00 A-42"}`)}, "--broker", rb.url, "--topic", topic)
	require.Equal(t, exitOK, r.code, r.stderr)
	got := received(t, msgs, 1)
	require.Equal(t, "order \U0001F600 A-42", string(got[0].Payload))
	require.Equal(t, "sent "+got[0].UUID+" key -\n", r.stdout)
}

// The built command reads 128 MiB of lines from a pipe, 64 KiB each, and
// sends them all, each line checked before the first is sent as before,
// without holding its input in memory: its peak resident memory stays
// under half of what it read. It used to keep every message until the
// last line was read, several times its input.
func TestPublishStreamsStandardInput(t *testing.T) {
	t.Parallel()
	const lines, size = 2048, 64 << 10
	bin := buildOncemill(t)
	rb := newRabbit(t)
	topic := rb.topic("publish-big", "$.billing")
	r := oncemill(t, nil, "amqp", "declare", "--url", rb.url, "--topic", topic, "--group", "billing")
	require.Equal(t, exitOK, r.code, r.stderr)

	cmd := exec.Command(bin, "publish", "--broker", rb.url, "--topic", topic, "--key", "bulk")
	stdin, err := cmd.StdinPipe()
	require.NoError(t, err)
	var out, errOut bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errOut
	require.NoError(t, cmd.Start())
	// The kernel's high-water mark of the command's own memory (VmHWM),
	// read while it runs: the rusage of a child that the test process
	// started counts the test process's memory too, which the child
	// shared until it exec'd.
	var peak atomic.Int64
	sampled := make(chan struct{})
	go func() {
		defer close(sampled)
		for {
			status, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", cmd.Process.Pid))
			if err != nil {
				return // it has exited
			}
			for _, l := range strings.Split(string(status), "\n") {
				if f := strings.Fields(l); len(f) == 3 && f[0] == "VmHWM:" {
					if kb, err := strconv.ParseInt(f[1], 10, 64); err == nil && kb<<10 > peak.Load() {
						peak.Store(kb << 10)
					}
				}
			}
			time.Sleep(10 * time.Millisecond) // a sampling period, not a wait for anything
		}
	}()
	payload := strings.Repeat("x", size-32)
	go func() {
		w := bufio.NewWriter(stdin)
		for i := range lines {
			fmt.Fprintf(w, "{\"payload\":\"%04d %s\"}\n", i, payload)
		}
		_ = w.Flush()
		_ = stdin.Close()
	}()
	require.NoError(t, cmd.Wait(), errOut.String())
	<-sampled
	require.Equal(t, lines, strings.Count(out.String(), "\nsent ")+1, "every line sent")
	require.Equal(t, lines, rb.ready(topic+".billing"))
	t.Logf("read %d MiB, peak resident memory %d MiB", lines*size>>20, peak.Load()>>20)
	require.Positive(t, peak.Load(), "sampled")
	require.Less(t, peak.Load(), int64(lines*size/2), "peak resident memory under half the input")
}
