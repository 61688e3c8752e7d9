package sqs

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"strconv"
	"strings"
	"sync"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/aws/aws-sdk-go-v2/service/sqs/types"

	"github.com/oncemill/oncemill/delivery"
)

const (
	// maxBatchEntries is how many messages SendMessageBatch accepts.
	maxBatchEntries = 10
	// maxBatchBytes bounds the size of one SendMessageBatch request. SQS
	// has accepted 1 MiB since 2025, but older deployments and emulators
	// accept 256 KiB; a larger message is sent on its own, where the
	// queue's MaximumMessageSize decides.
	maxBatchBytes = 256 * 1024
	// maxFIFOIDLength is the longest MessageGroupId and
	// MessageDeduplicationId SQS accepts.
	maxFIFOIDLength = 128
)

// Publisher publishes Watermill messages to SQS queues, one queue per
// topic. It is safe for concurrent use. It starts no goroutines.
type Publisher struct {
	cfg    PublisherConfig
	client *client
	logger watermill.LoggerAdapter

	mu       sync.RWMutex
	closed   bool
	inflight sync.WaitGroup
}

var _ message.Publisher = (*Publisher)(nil)

// NewPublisher returns a publisher for cfg. It validates a copy of cfg with
// its defaults applied and builds the SQS client; it makes no request and
// starts no goroutines, so an unreachable endpoint shows in the first
// Publish.
func NewPublisher(cfg PublisherConfig) (*Publisher, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	c, err := newClient(cfg.Config)
	if err != nil {
		return nil, err
	}
	return &Publisher{cfg: cfg, client: c, logger: cfg.Logger}, nil
}

// entry is one message ready to send.
type entry struct {
	msg     *message.Message
	body    string
	attrs   map[string]types.MessageAttributeValue
	size    int
	groupID string
	dedupID string
	fifo    bool
}

// Publish sends msgs to topic's queue, in order, and returns once SQS has
// stored them all or one failed. Several messages are sent with
// SendMessageBatch, up to 10 (and 256 KiB) per request; the requests use
// the context of their first message. Publish is not atomic: when a request
// fails, the messages of earlier requests are stored and those of later
// ones are not sent, and within a failed batch SQS may have stored some.
// Every message is checked before anything is sent.
//
// The queue URL is looked up once per topic and cached; with
// [Config.CreateQueueIfMissing] a missing queue is created.
//
// For a FIFO queue (name ending in ".fifo") each message's MessageGroupId is
// [delivery.PartitionKeyOf] the message, else its UUID, and its
// MessageDeduplicationId is its delivery.IdempotencyKey metadata, else its
// UUID; an ID longer than 128 characters or with characters SQS does not
// accept is replaced by its SHA-256 in hex. A replay from the dead-letter
// queue (metadata delivery.Replay) and a dead-lettered copy (the
// delivery.Dead* fields) get a deduplication ID of their own, derived from
// the key and those fields, so that SQS does not drop them as copies of the
// original within its five-minute deduplication window, while a retry of
// the same publish is still dropped.
func (p *Publisher) Publish(topic string, msgs ...*message.Message) error {
	p.mu.RLock()
	if p.closed {
		p.mu.RUnlock()
		return fmt.Errorf("sqs: publish to %q: %w", topic, ErrClosed)
	}
	p.inflight.Add(1)
	p.mu.RUnlock()
	defer p.inflight.Done()

	if len(msgs) == 0 {
		return nil
	}
	name, url, err := p.client.queueURL(msgs[0].Context(), topic, p.cfg.CreateQueueIfMissing)
	if err != nil {
		return fmt.Errorf("sqs: publish to %q: %w", topic, err)
	}
	fifo := isFIFO(name)
	entries := make([]entry, len(msgs))
	for i, msg := range msgs {
		e, err := newEntry(msg, fifo)
		if err != nil {
			return fmt.Errorf("sqs: publish message %s to %q: %w", msg.UUID, topic, err)
		}
		entries[i] = e
	}

	for len(entries) > 0 {
		n, size := 1, entries[0].size
		for n < len(entries) && n < maxBatchEntries && size+entries[n].size <= maxBatchBytes {
			size += entries[n].size
			n++
		}
		chunk := entries[:n]
		entries = entries[n:]
		if len(chunk) == 1 {
			err = p.sendOne(name, url, chunk[0])
		} else {
			err = p.sendBatch(name, url, chunk)
		}
		if err != nil {
			return fmt.Errorf("sqs: publish to %q: %w", topic, err)
		}
	}
	p.logger.Trace("Published messages to SQS", watermill.LogFields{"topic": topic, "queue": name, "count": len(msgs)})
	return nil
}

// newEntry marshals msg for a standard or FIFO queue.
func newEntry(msg *message.Message, fifo bool) (entry, error) {
	body, attrs, err := marshal(msg)
	if err != nil {
		return entry{}, err
	}
	e := entry{msg: msg, body: body, attrs: attrs, size: len(body), fifo: fifo}
	for name, v := range attrs {
		e.size += len(name) + len(aws.ToString(v.DataType)) + len(aws.ToString(v.StringValue)) + len(v.BinaryValue)
	}
	if fifo {
		e.groupID = fifoID(delivery.PartitionKeyOf(msg), msg.UUID)
		e.dedupID = dedupID(msg)
	}
	return e, nil
}

// dedupID returns msg's MessageDeduplicationId. SQS drops a message whose
// ID it has seen in the last five minutes, so the ID names one logical
// publish: the same for a producer's retries of it, different for another
// publish of the same message. A message that is neither a replay nor a
// dead letter has its idempotency key, else its UUID, as [fifoID] makes it.
// A replay from the dead-letter queue (delivery.Replay, the replay grant,
// fresh for every replay) and a dead-lettered copy (delivery.DeadConsumer
// and delivery.DeadLastFailedAt, which differ between two dead-letterings
// of one message) are publishes of their own: their ID is the SHA-256, in
// hex, of the key and those fields, after as much of the key as fits in
// 128 characters when SQS accepts its characters.
func dedupID(msg *message.Message) string {
	key := msg.Metadata.Get(delivery.IdempotencyKey)
	if key == "" {
		key = msg.UUID
	}
	extra := []string{
		msg.Metadata.Get(delivery.Replay),
		msg.Metadata.Get(delivery.DeadConsumer),
		msg.Metadata.Get(delivery.DeadLastFailedAt),
	}
	if extra[0] == "" && extra[1] == "" && extra[2] == "" {
		return fifoID(key)
	}
	h := sha256.New()
	for _, f := range append([]string{key}, extra...) {
		var n [8]byte
		binary.BigEndian.PutUint64(n[:], uint64(len(f)))
		h.Write(n[:])
		h.Write([]byte(f))
	}
	sum := hex.EncodeToString(h.Sum(nil))
	if !validFIFOID(key) {
		return sum
	}
	return key[:min(len(key), maxFIFOIDLength-len(sum)-1)] + ":" + sum
}

// validFIFOID reports whether SQS accepts id's characters in a
// MessageGroupId or MessageDeduplicationId: ASCII letters, digits and
// punctuation, at least one.
func validFIFOID(id string) bool {
	return id != "" && strings.IndexFunc(id, func(r rune) bool { return r < 0x21 || r > 0x7e }) < 0
}

// fifoID returns the first non-empty of ids as a MessageGroupId or
// MessageDeduplicationId: as it is when SQS accepts it (1 to 128 of ASCII
// letters, digits and punctuation), else its SHA-256 in hex. With all ids
// empty it returns a new random UUID.
func fifoID(ids ...string) string {
	for _, id := range ids {
		if id == "" {
			continue
		}
		if len(id) <= maxFIFOIDLength && validFIFOID(id) {
			return id
		}
		sum := sha256.Sum256([]byte(id))
		return hex.EncodeToString(sum[:])
	}
	return watermill.NewUUID()
}

// sendOne sends e with SendMessage.
func (p *Publisher) sendOne(name, url string, e entry) error {
	in := &sqs.SendMessageInput{
		QueueUrl:          aws.String(url),
		MessageBody:       aws.String(e.body),
		MessageAttributes: e.attrs,
	}
	if e.fifo {
		in.MessageGroupId = aws.String(e.groupID)
		in.MessageDeduplicationId = aws.String(e.dedupID)
	}
	if _, err := p.client.api.SendMessage(e.msg.Context(), in); err != nil {
		p.forgetIfGone(name, err)
		return fmt.Errorf("send message %s to queue %q: %w", e.msg.UUID, name, err)
	}
	return nil
}

// sendBatch sends entries, at most 10, with SendMessageBatch.
func (p *Publisher) sendBatch(name, url string, entries []entry) error {
	in := &sqs.SendMessageBatchInput{
		QueueUrl: aws.String(url),
		Entries:  make([]types.SendMessageBatchRequestEntry, len(entries)),
	}
	for i, e := range entries {
		be := types.SendMessageBatchRequestEntry{
			Id:                aws.String(strconv.Itoa(i)),
			MessageBody:       aws.String(e.body),
			MessageAttributes: e.attrs,
		}
		if e.fifo {
			be.MessageGroupId = aws.String(e.groupID)
			be.MessageDeduplicationId = aws.String(e.dedupID)
		}
		in.Entries[i] = be
	}
	out, err := p.client.api.SendMessageBatch(entries[0].msg.Context(), in)
	if err != nil {
		p.forgetIfGone(name, err)
		return fmt.Errorf("send %d messages to queue %q: %w", len(entries), name, err)
	}
	if len(out.Failed) == 0 {
		return nil
	}
	failed := make([]string, 0, len(out.Failed))
	for _, f := range out.Failed {
		uuid := aws.ToString(f.Id)
		if i, err := strconv.Atoi(uuid); err == nil && i >= 0 && i < len(entries) {
			uuid = entries[i].msg.UUID
		}
		failed = append(failed, fmt.Sprintf("message %s: %s: %s", uuid, aws.ToString(f.Code), aws.ToString(f.Message)))
	}
	return fmt.Errorf("%w: queue %q rejected %d of %d messages: %s", ErrPublish, name, len(out.Failed), len(entries), strings.Join(failed, "; "))
}

// forgetIfGone drops the cached URL of queue name when err says the queue
// does not exist, so that the next Publish looks it up again.
func (p *Publisher) forgetIfGone(name string, err error) {
	if isQueueNotFound(err) {
		p.client.forget(name)
	}
}

// Close marks the publisher closed, waits for the Publish calls in flight
// and releases the HTTP connections the publisher opened. Publish then
// fails with [ErrClosed]. Close is idempotent and always returns nil.
func (p *Publisher) Close() error {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return nil
	}
	p.closed = true
	p.mu.Unlock()
	p.inflight.Wait()
	p.client.close()
	return nil
}
