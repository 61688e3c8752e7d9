package forwarder

import (
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/internal/sqldb"
)

// ErrRefusedRow is wrapped by the reason the relay gives for an outbox
// row it cannot turn into a message: an empty topic or uuid, metadata
// that is not a JSON object of strings (JSON null counts as no metadata),
// or a topic that the publisher's broker refuses ([TopicValidator]).
// Such a row cannot become valid by waiting, and keeping it would hold
// every batch that takes its lane: the relay dead-letters it instead, in
// the batch's transaction, to the dead-letter table (sqlschema.Config's
// DLQTable) with the reason as its error, consumer "relay:" followed by
// the outbox table (schema.table), permanent, and logs it at Error
// ("Outbox row refused, dead-lettered"). The rows behind it in its lane
// go on. Each refused row is one dead letter, its uuid, topic and key in
// their bounded form (sqldb.Ident), its error and metadata as text; a row
// whose uuid the table holds already is
// filed under a uuid made unique for it (see [deadLetterRow]). A row whose metadata was refused is dead-lettered with empty
// metadata, the column's text being quoted in the error.
var ErrRefusedRow = errors.New("forwarder: outbox row refused")

// relayConsumer is the consumer column of the dead letters of the relay
// of outbox (schema.table).
func relayConsumer(outbox string) string { return "relay:" + outbox }

// TopicValidator is a publisher that can tell, before publishing, a
// topic its broker refuses for its shape: too long for the broker's
// frame (AMQP's 255-byte names), not valid UTF-8 where the broker needs
// it, or against the broker's naming rules (a NATS subject with spaces or
// wildcards, a Kafka topic with characters outside [a-zA-Z0-9._-]). The
// relay asks it for each row's topic and refuses a row whose topic it
// rejects ([ErrRefusedRow]): such a row would fail its publish on every
// try, and with it the rows published before it in the batch, which
// would go out again and again, while a broker that closes the channel or
// connection on such a frame would make the relay reconnect in a loop.
// oncemill's AMQP, Kafka and NATS publishers implement it.
type TopicValidator interface {
	// ValidateTopic returns why the broker would refuse topic, or nil.
	ValidateTopic(topic string) error
}

// checkRow decodes a row's metadata column and reports why the row cannot
// be published, if it cannot: validate, when not nil, is the publisher's
// TopicValidator. It returns the metadata and the message's UUID: uuid,
// or the whole UUID the metadata keeps when the column holds its bounded
// form (see sqldb.EncodeMetadata, which the outbox's publishers write
// through).
func checkRow(topic, uuid string, metadata []byte, validate func(string) error) (map[string]string, string, error) {
	md, exact, err := sqldb.DecodeMetadata(metadata)
	if err != nil {
		return nil, uuid, fmt.Errorf("%w: metadata is not a JSON object of strings (%v): %q", ErrRefusedRow, err, clip(metadata, 500))
	}
	if exact != "" {
		uuid = exact
	}
	switch {
	case topic == "":
		return md, uuid, fmt.Errorf("%w: topic is empty", ErrRefusedRow)
	case uuid == "":
		return md, uuid, fmt.Errorf("%w: uuid is empty", ErrRefusedRow)
	}
	if validate != nil {
		if err := validate(topic); err != nil {
			return md, uuid, fmt.Errorf("%w: the publisher refuses the topic: %w", ErrRefusedRow, err)
		}
	}
	return md, uuid, nil
}

// topicValidation is pub's ValidateTopic, or nil when pub has none.
func topicValidation(pub any) func(string) error {
	if v, ok := pub.(TopicValidator); ok {
		return v.ValidateTopic
	}
	return nil
}

// deadLetterRow writes the dead letter of the refused row x through
// insert, which inserts one with the given uuid column and metadata and
// reports whether it did: false when the table holds an entry already
// for the same consumer, topic, uuid and key. The uuid column holds x's
// uuid in its sqldb.Ident form, so that an oversize one, or one that is
// not text, fits the table's index. Each refused row is one dead letter:
// a row whose uuid is taken (two rows of one uuid and key refused, or a
// uuid that was dead-lettered before) is written under a uuid made
// unique for the row ("<uuid>#outbox-row-<id>-<random>"), the row's own
// uuid kept in delivery.DeadUUID, which a replay publishes with, rather
// than merged into the other entry and lost with the outbox row's delete.
func deadLetterRow(x row, insert func(uuid, metadata string) (bool, error)) error {
	uuid := sqldb.Ident(x.uuid)
	done, err := insert(uuid, x.deadMetadata(uuid))
	if err != nil || done {
		return err
	}
	var salt [4]byte
	_, _ = rand.Read(salt[:])
	uuid = sqldb.Ident(fmt.Sprintf("%s#outbox-row-%d-%x", x.uuid, x.id, salt))
	if done, err = insert(uuid, x.deadMetadata(uuid)); err == nil && !done {
		err = fmt.Errorf("the dead-letter table holds an entry of uuid %q already", uuid)
	}
	return err
}

// deadMetadata is the metadata of a refused row's dead letter, filed
// under uuid: the row's, if it could be read, else none; with
// delivery.DeadUUID holding the row's uuid when uuid is another; as the
// dead-letter table keeps metadata, text (sqldb.CleanMetadata).
func (x row) deadMetadata(uuid string) string {
	md := make(map[string]string, len(x.metadata)+1)
	for k, v := range x.metadata {
		md[k] = v
	}
	if uuid != x.uuid {
		md[delivery.DeadUUID] = x.uuid
	}
	b, err := json.Marshal(sqldb.CleanMetadata(md))
	if err != nil {
		return "{}"
	}
	return string(b)
}

func clip(b []byte, n int) string {
	if len(b) > n {
		return string(b[:n]) + "…"
	}
	return string(b)
}
