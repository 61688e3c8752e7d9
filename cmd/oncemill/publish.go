package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/oncemill/oncemill/delivery"
)

// publishGroup is the consumer group publish opens the broker with: it
// only publishes, the group merely satisfies brokers whose URL needs one
// (Kafka).
const publishGroup = "oncemill-publish"

// maxPublishLine bounds one line of publish's standard input.
const maxPublishLine = 16 << 20

// publishHelp is publish's help after its synopsis.
const publishHelp = `Publishes messages to --topic through the broker --broker names, as a
service that uses oncemill's adapters does: with a UUID, the
idempotency_key and partition_key metadata that the consumers' inboxes and
the partitioning brokers read, publisher confirms, and on RabbitMQ a
mandatory publish that fails when no queue is bound to the topic. It
prints one line per message the broker took: "sent UUID key KEY" ("-" for
no key).

Each PAYLOAD argument is one message, its bytes as given. Without one,
publish reads messages from standard input, one JSON object per line
(empty lines are skipped):

  {"uuid": "…", "key": "…", "partition_key": "…",
   "metadata": {"name": "value"}, "payload": {"orderId": "A-42"}}

payload is required: a JSON string is sent as its text, any other JSON
value as its JSON. uuid, key, partition_key and metadata are optional;
--key, --partition-key and --meta apply to the lines that do not set them,
and a line without uuid gets a new one. Every line is read and checked
before the first is sent: a bad line is named by its number and field, and
nothing is sent. A publish the broker refuses stops the command; the
messages printed before it were sent, the rest were not.`

// publishLine is one line of publish's standard input.
type publishLine struct {
	UUID         string            `json:"uuid"`
	Key          string            `json:"key"`
	PartitionKey string            `json:"partition_key"`
	Metadata     map[string]string `json:"metadata"`
	Payload      json.RawMessage   `json:"payload"`
}

// outgoing is a message to publish and where it came from ("argument 2",
// "line 7"), for the errors that name it.
type outgoing struct {
	msg  *message.Message
	from string
}

// publish sends messages to a topic: see publishHelp.
func (c *cmd) publish(ctx context.Context, args []string) (err error) {
	var (
		broker, topic, id, key, partition string
		meta                              = map[string]string{}
	)
	fs := newFlags(c.name)
	fs.StringVar(&broker, "broker", "", "`URL` of the broker to publish to, as adapters.Open reads it: kafka://…, amqp://…, sqs://…, nats://…, postgres://… (default $BROKER_URL; gochannel:// and kafka:// or nats:// with no host, brokers inside this process, are refused)")
	fs.StringVar(&topic, "topic", "", "`TOPIC` to publish to (required)")
	fs.StringVar(&id, "uuid", "", "`UUID` of the message, for one PAYLOAD argument (default a new one per message)")
	fs.StringVar(&key, "key", "", "`KEY` of the messages' effect: their "+delivery.IdempotencyKey+" metadata, which the inbox's default key reads")
	fs.StringVar(&partition, "partition-key", "", "`KEY` that orders the messages: their "+delivery.PartitionKey+" metadata (Kafka's record key, SQS FIFO's group)")
	fs.Func("meta", "metadata `NAME=VALUE` of the messages; repeat for more", func(s string) error {
		name, value, ok := strings.Cut(s, "=")
		if !ok || name == "" {
			return fmt.Errorf("%q is not NAME=VALUE", s)
		}
		if _, dup := meta[name]; dup {
			return fmt.Errorf("%q is given twice", name)
		}
		meta[name] = value
		return nil
	})
	payloads, err := parse(fs, args)
	if err != nil {
		return err
	}
	if topic == "" {
		return usagef("--topic is required")
	}
	for name, flag := range map[string]string{delivery.IdempotencyKey: "--key", delivery.PartitionKey: "--partition-key"} {
		if _, ok := meta[name]; ok {
			return usagef("--meta %s: give it with %s", name, flag)
		}
	}
	if id != "" && len(payloads) != 1 {
		return usagef("--uuid names one message: give exactly one PAYLOAD argument (lines on standard input carry their own \"uuid\")")
	}
	if broker, err = c.required("--broker", broker, "BROKER_URL"); err != nil {
		return err
	}
	if err := checkDurableBroker("--broker", broker, "nothing sent"); err != nil {
		return err
	}
	defaults := publishLine{UUID: id, Key: key, PartitionKey: partition, Metadata: meta}

	var out []outgoing
	if len(payloads) > 0 {
		for i, p := range payloads {
			line := defaults
			line.Payload = nil
			msg := line.message([]byte(p))
			out = append(out, outgoing{msg: msg, from: fmt.Sprintf("argument %d", i+1)})
		}
	} else {
		stdin := c.stdin
		if stdin == nil {
			stdin = os.Stdin
		}
		if out, err = readPublishLines(stdin, defaults); err != nil {
			var uerr usageError
			if errors.As(err, &uerr) {
				return usagef("%s; nothing sent", uerr.msg)
			}
			return fmt.Errorf("%w; nothing sent", err)
		}
		if len(out) == 0 {
			return usagef("no PAYLOAD argument and no message on standard input; nothing sent")
		}
	}

	ps, err := openBroker(ctx, "--broker", broker, publishGroup, "nothing sent", watermill.NopLogger{})
	if err != nil {
		return err
	}
	defer closeBroker(ps, &err)
	for i, o := range out {
		if err := ps.Publisher.Publish(topic, o.msg); err != nil {
			return fmt.Errorf("sent %d of %d %s, then %s (uuid %s) failed: %w",
				i, len(out), plural(len(out), "message", "messages"), o.from, o.msg.UUID, err)
		}
		k := o.msg.Metadata.Get(delivery.IdempotencyKey)
		if k == "" {
			k = "-"
		}
		fmt.Fprintf(c.stdout, "sent %s key %s\n", o.msg.UUID, k)
	}
	return nil
}

// message is the message line describes, with payload.
func (l publishLine) message(payload []byte) *message.Message {
	id := l.UUID
	if id == "" {
		id = watermill.NewUUID()
	}
	msg := message.NewMessage(id, payload)
	for name, value := range l.Metadata {
		msg.Metadata.Set(name, value)
	}
	if l.Key != "" {
		msg.Metadata.Set(delivery.IdempotencyKey, l.Key)
	}
	if l.PartitionKey != "" {
		msg.Metadata.Set(delivery.PartitionKey, l.PartitionKey)
	}
	return msg
}

// readPublishLines reads every line of r as a [publishLine], the unset
// fields taken from defaults, and returns their messages; the first bad
// line is an error naming its number and field.
func readPublishLines(r io.Reader, defaults publishLine) ([]outgoing, error) {
	var out []outgoing
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 64<<10), maxPublishLine)
	for n := 1; sc.Scan(); n++ {
		text := bytes.TrimSpace(sc.Bytes())
		if len(text) == 0 {
			continue
		}
		msg, err := parsePublishLine(text, defaults)
		if err != nil {
			return nil, usagef("standard input, line %d: %v", n, err)
		}
		out = append(out, outgoing{msg: msg, from: fmt.Sprintf("line %d", n)})
	}
	if err := sc.Err(); err != nil {
		if errors.Is(err, bufio.ErrTooLong) {
			return nil, usagef("standard input, line %d: longer than %d MiB", len(out)+1, maxPublishLine>>20)
		}
		return nil, fmt.Errorf("read standard input: %w", err)
	}
	return out, nil
}

// publishFields are the fields of a line of publish's standard input.
var publishFields = []string{"uuid", "key", "partition_key", "metadata", "payload"}

// parsePublishLine reads one line of publish's standard input.
func parsePublishLine(text []byte, defaults publishLine) (*message.Message, error) {
	dec := json.NewDecoder(bytes.NewReader(text))
	var fields map[string]json.RawMessage
	if err := dec.Decode(&fields); err != nil {
		return nil, fmt.Errorf("not a JSON object: %w", err)
	}
	for name := range fields {
		if !slices.Contains(publishFields, name) {
			return nil, fmt.Errorf("unknown field %q: the fields are %s", name, strings.Join(publishFields, ", "))
		}
	}
	var l publishLine
	if err := json.Unmarshal(text, &l); err != nil {
		var typeErr *json.UnmarshalTypeError
		if !errors.As(err, &typeErr) {
			return nil, fmt.Errorf("not a JSON object: %w", err)
		}
		field, _, _ := strings.Cut(typeErr.Field, ".")
		want := "a string"
		if field == "metadata" {
			want = "an object of string values"
		}
		return nil, fmt.Errorf("field %q: want %s, got a JSON %s", field, want, typeErr.Value)
	}
	if dec.More() {
		return nil, errors.New("more than one JSON value: give one object per line")
	}
	if len(l.Payload) == 0 || string(l.Payload) == "null" {
		return nil, errors.New(`field "payload" is missing: give the message's body as a JSON string or value`)
	}
	payload := []byte(l.Payload)
	if l.Payload[0] == '"' {
		var s string
		if err := json.Unmarshal(l.Payload, &s); err != nil {
			return nil, fmt.Errorf("field %q: %w", "payload", err)
		}
		payload = []byte(s)
	} else {
		var compact bytes.Buffer
		if err := json.Compact(&compact, l.Payload); err == nil {
			payload = compact.Bytes()
		}
	}
	for _, name := range []string{delivery.IdempotencyKey, delivery.PartitionKey} {
		if _, ok := l.Metadata[name]; ok {
			field := map[string]string{delivery.IdempotencyKey: "key", delivery.PartitionKey: "partition_key"}[name]
			return nil, fmt.Errorf("field \"metadata\": %s: give it as the field %q", name, field)
		}
	}
	if l.Key == "" {
		l.Key = defaults.Key
	}
	if l.PartitionKey == "" {
		l.PartitionKey = defaults.PartitionKey
	}
	meta := make(map[string]string, len(defaults.Metadata)+len(l.Metadata))
	for k, v := range defaults.Metadata {
		meta[k] = v
	}
	for k, v := range l.Metadata {
		meta[k] = v
	}
	l.Metadata = meta
	return l.message(payload), nil
}
