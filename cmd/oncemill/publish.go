package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"net/url"
	"os"
	"slices"
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/oncemill/oncemill/delivery"
)

// publishGroup is the consumer group publish opens Kafka and NATS with,
// whose URLs need one though publish only publishes. The other brokers
// are opened with none: a group names a queue on RabbitMQ, and the
// unroutable publish's hint would tell the user to declare this one,
// which no consumer reads and which would then fill with every message.
const publishGroup = "oncemill-publish"

// publishGroupFor is the group publish opens broker with: publishGroup
// for the schemes that need one, else none.
func publishGroupFor(broker string) string {
	if u, err := url.Parse(broker); err == nil && (u.Scheme == "kafka" || u.Scheme == "nats") {
		return publishGroup
	}
	return ""
}

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
and a line without uuid gets a new one. A line is UTF-8 text; a field given
twice, an empty key or partition_key, and a string that holds half of a
UTF-16 surrogate pair are refused, not guessed at. Every line is read and
checked before the first is sent: a bad line is named by its number and
field, and nothing is sent. Standard input is not held in memory for
that: a file is read twice, a pipe is copied to a temporary file (in
$TMPDIR, readable by its owner only, removed at exit) as it is checked. A
publish the broker refuses stops the command; the messages printed before
it were sent, the rest were not.`

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

	var (
		total int
		each  func(send func(outgoing) error) error
	)
	if len(payloads) > 0 {
		total = len(payloads)
		each = func(send func(outgoing) error) error {
			for i, p := range payloads {
				line := defaults
				line.Payload = nil
				if err := send(outgoing{msg: line.message([]byte(p)), from: fmt.Sprintf("argument %d", i+1)}); err != nil {
					return err
				}
			}
			return nil
		}
	} else {
		stdin := c.stdin
		if stdin == nil {
			stdin = os.Stdin
		}
		var in *publishInput
		if in, err = checkPublishInput(stdin, defaults); err != nil {
			var uerr usageError
			if errors.As(err, &uerr) {
				return usagef("%s; nothing sent", uerr.msg)
			}
			return fmt.Errorf("%w; nothing sent", err)
		}
		defer func() { err = errors.Join(err, in.close()) }()
		if in.lines == 0 {
			return usagef("no PAYLOAD argument and no message on standard input; nothing sent")
		}
		total, each = in.lines, in.each
	}

	ps, err := openBroker(ctx, "--broker", broker, publishGroupFor(broker), "nothing sent", watermill.NopLogger{})
	if err != nil {
		return err
	}
	defer closeBroker(ps, &err)
	sent := 0
	return each(func(o outgoing) error {
		if err := ps.Publisher.Publish(topic, o.msg); err != nil {
			return fmt.Errorf("sent %d of %d %s, then %s (uuid %s) failed: %w",
				sent, total, plural(total, "message", "messages"), o.from, o.msg.UUID, err)
		}
		sent++
		k := o.msg.Metadata.Get(delivery.IdempotencyKey)
		if k == "" {
			k = "-"
		}
		fmt.Fprintf(c.stdout, "sent %s key %s\n", o.msg.UUID, k)
		return nil
	})
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

// publishInput is publish's standard input, every line of it checked,
// ready to be read again for sending without being held in memory.
type publishInput struct {
	// lines counts the messages: the lines that are not blank.
	lines int
	// again reads the checked lines again from their start.
	again    io.Reader
	defaults publishLine
	close    func() error
}

// checkPublishInput reads every line of r and checks it as a
// [publishLine], the unset fields taken from defaults; the first bad line
// is an error naming its number and field. A reader that can seek (a
// file) is read again from where it was; any other (a pipe) is copied to
// a temporary file as it is read, so that no more than a line is held in
// memory either way.
func checkPublishInput(r io.Reader, defaults publishLine) (in *publishInput, err error) {
	in = &publishInput{defaults: defaults, close: func() error { return nil }}
	src := r
	rs, seekable := r.(io.ReadSeeker)
	var start int64
	if seekable {
		if start, err = rs.Seek(0, io.SeekCurrent); err != nil {
			seekable = false
		}
	}
	var spool *os.File
	var copyTo *bufio.Writer
	if !seekable {
		if spool, err = os.CreateTemp("", "oncemill-publish-*.jsonl"); err != nil {
			return nil, fmt.Errorf("standard input: a temporary file to hold it while it is checked: %w", err)
		}
		remove := func() error { return errors.Join(spool.Close(), os.Remove(spool.Name())) }
		in.close = remove
		defer func() {
			if err != nil {
				err = errors.Join(err, remove())
			}
		}()
		copyTo = bufio.NewWriter(spool)
		src = io.TeeReader(r, copyTo)
	}
	err = scanPublishLines(src, func(n int, text []byte) error {
		if _, err := parsePublishLine(text, defaults); err != nil {
			return usagef("standard input, line %d: %v", n, err)
		}
		in.lines++
		return nil
	})
	if err != nil {
		return nil, err
	}
	if seekable {
		if _, err := rs.Seek(start, io.SeekStart); err != nil {
			return nil, fmt.Errorf("standard input: read it again to send it: %w", err)
		}
		in.again = rs
		return in, nil
	}
	if err := copyTo.Flush(); err != nil {
		return nil, fmt.Errorf("standard input: copy it to %s while it is checked: %w", spool.Name(), err)
	}
	if _, err := spool.Seek(0, io.SeekStart); err != nil {
		return nil, fmt.Errorf("standard input: read %s again to send it: %w", spool.Name(), err)
	}
	in.again = spool
	return in, nil
}

// each reads the checked lines again and calls send with the message of
// each, in order; it stops at send's first error.
func (in *publishInput) each(send func(outgoing) error) error {
	return scanPublishLines(in.again, func(n int, text []byte) error {
		msg, err := parsePublishLine(text, in.defaults)
		if err != nil {
			// Checked already: only a file changed in between gets here.
			return fmt.Errorf("standard input, line %d changed since it was checked: %w", n, err)
		}
		return send(outgoing{msg: msg, from: fmt.Sprintf("line %d", n)})
	})
}

// scanPublishLines calls fn with every line of r that is not blank, and
// its number, counting the blank ones, until fn's first error.
func scanPublishLines(r io.Reader, fn func(n int, text []byte) error) error {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 64<<10), maxPublishLine)
	n := 0
	for sc.Scan() {
		n++
		text := bytes.TrimSpace(sc.Bytes())
		if len(text) == 0 {
			continue
		}
		if err := fn(n, text); err != nil {
			return err
		}
	}
	if err := sc.Err(); err != nil {
		if errors.Is(err, bufio.ErrTooLong) {
			return usagef("standard input, line %d: longer than %d MiB", n+1, maxPublishLine>>20)
		}
		return fmt.Errorf("read standard input: %w", err)
	}
	return nil
}

// publishFields are the fields of a line of publish's standard input.
var publishFields = []string{"uuid", "key", "partition_key", "metadata", "payload"}

// parsePublishLine reads one line of publish's standard input.
func parsePublishLine(text []byte, defaults publishLine) (*message.Message, error) {
	if at := notUTF8(text); at >= 0 {
		return nil, fmt.Errorf("byte %d is not UTF-8: a line is JSON text in UTF-8; send a payload that is not text as a PAYLOAD argument", at+1)
	}
	dec := json.NewDecoder(bytes.NewReader(text))
	var fields map[string]json.RawMessage
	if err := dec.Decode(&fields); err != nil {
		return nil, fmt.Errorf("not a JSON object: %w", err)
	}
	// In order, so that a line with two unknown fields names the same
	// one every time.
	for _, name := range slices.Sorted(maps.Keys(fields)) {
		if !slices.Contains(publishFields, name) {
			return nil, fmt.Errorf("unknown field %q: the fields are %s", name, strings.Join(publishFields, ", "))
		}
	}
	// The decoders keep the last of a name given twice, silently.
	if name, ok := givenTwice(text); ok {
		return nil, fmt.Errorf("field %q is given twice: give each field once", name)
	}
	if name, ok := givenTwice(fields["metadata"]); ok {
		return nil, fmt.Errorf("field \"metadata\": %q is given twice: give each name once", name)
	}
	// And they turn half of a surrogate pair into U+FFFD, silently.
	for _, name := range publishFields {
		if esc, ok := loneSurrogate(fields[name]); ok {
			return nil, fmt.Errorf("field %q: %s is half of a UTF-16 surrogate pair, which no UTF-8 text can hold: give the pair, or the character as UTF-8", name, esc)
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
	for _, f := range []struct {
		name, flag, given, dflt string
	}{{"key", "--key", l.Key, defaults.Key}, {"partition_key", "--partition-key", l.PartitionKey, defaults.PartitionKey}} {
		if _, set := fields[f.name]; !set || f.given != "" {
			continue
		}
		// An empty value given is neither the flag's nor no value.
		if f.dflt != "" {
			return nil, fmt.Errorf("field %q is empty: leave it out to take %s (%q), or give one", f.name, f.flag, f.dflt)
		}
		return nil, fmt.Errorf("field %q is empty: leave it out for a message without one, or give one", f.name)
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

// notUTF8 returns the offset of the first byte of text that is not
// UTF-8, or -1.
func notUTF8(text []byte) int {
	for i := 0; i < len(text); {
		r, size := utf8.DecodeRune(text[i:])
		if r == utf8.RuneError && size <= 1 {
			return i
		}
		i += size
	}
	return -1
}

// givenTwice reports a name that the JSON object raw gives twice; it
// reports none for anything that is not an object.
func givenTwice(raw []byte) (string, bool) {
	dec := json.NewDecoder(bytes.NewReader(raw))
	if tok, err := dec.Token(); err != nil || tok != json.Delim('{') {
		return "", false
	}
	seen := map[string]bool{}
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return "", false
		}
		name, _ := tok.(string)
		if seen[name] {
			return name, true
		}
		seen[name] = true
		var skip json.RawMessage
		if err := dec.Decode(&skip); err != nil {
			return "", false
		}
	}
	return "", false
}

// loneSurrogate finds in the JSON text raw an escape \uD800 to \uDFFF
// that is not part of a pair: a high one followed by a low one.
func loneSurrogate(raw []byte) (string, bool) {
	hex4 := func(i int) (rune, bool) {
		if i+6 > len(raw) || raw[i] != '\\' || raw[i+1] != 'u' {
			return 0, false
		}
		v, err := strconv.ParseUint(string(raw[i+2:i+6]), 16, 16)
		return rune(v), err == nil
	}
	// A backslash is in a string in valid JSON, and starts an escape.
	for i := 0; i < len(raw); i++ {
		if raw[i] != '\\' {
			continue
		}
		r, ok := hex4(i)
		if !ok {
			i++ // a one-letter escape: skip its letter
			continue
		}
		switch {
		case r >= 0xD800 && r < 0xDC00:
			if low, ok := hex4(i + 6); ok && low >= 0xDC00 && low <= 0xDFFF {
				i += 11
				continue
			}
			return string(raw[i : i+6]), true
		case r >= 0xDC00 && r <= 0xDFFF:
			return string(raw[i : i+6]), true
		}
		i += 5
	}
	return "", false
}
