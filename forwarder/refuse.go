package forwarder

import (
	"encoding/json"
	"errors"
	"fmt"

	"github.com/oncemill/oncemill/sqlschema"
)

// ErrRefusedRow is wrapped by the reason the relay gives for an outbox
// row it cannot turn into a message: an empty topic or uuid, or metadata
// that is not a JSON object of strings (JSON null counts as no metadata).
// Such a row cannot become valid by waiting, and keeping it would hold
// every batch that takes its lane: the relay dead-letters it instead, in
// the batch's transaction, to the dead-letter table (sqlschema.Config's
// DLQTable) with the reason as its error, consumer "relay:" followed by
// the outbox table (schema.table), permanent, and logs it at Error
// ("Outbox row refused, dead-lettered"). The rows behind it in its lane
// go on. A row whose metadata was refused is dead-lettered with empty
// metadata, the column's text being quoted in the error.
var ErrRefusedRow = errors.New("forwarder: outbox row refused")

// relayConsumer is the consumer column of the dead letters of the relay
// of outbox (schema.table).
func relayConsumer(outbox string) string { return "relay:" + outbox }

// checkRow decodes a row's metadata column and reports why the row cannot
// be published, if it cannot.
func checkRow(topic, uuid string, metadata []byte) (map[string]string, error) {
	var md map[string]string
	if err := json.Unmarshal(metadata, &md); err != nil {
		return nil, fmt.Errorf("%w: metadata is not a JSON object of strings (%v): %q", ErrRefusedRow, err, clip(metadata, 500))
	}
	switch {
	case topic == "":
		return md, fmt.Errorf("%w: topic is empty", ErrRefusedRow)
	case uuid == "":
		return md, fmt.Errorf("%w: uuid is empty", ErrRefusedRow)
	}
	return md, nil
}

// deadMetadata is the metadata of a refused row's dead letter: the row's,
// if it could be read, else none.
func (x row) deadMetadata() string {
	if x.metadata == nil {
		return "{}"
	}
	b, err := json.Marshal(x.metadata)
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

// pgDeadLetter writes a refused row to the PostgreSQL dead-letter table
// (arguments: uuid, topic, consumer, key, error, payload, metadata), once
// per consumer, topic and uuid, as dlq.Publisher does.
func pgDeadLetter(names sqlschema.Names) string {
	return `INSERT INTO ` + names.DLQ + ` (uuid, topic, consumer, key, error, permanent, first_failed_at, last_failed_at, payload, metadata)
VALUES ($1, $2, $3, $4, $5, true, now(), now(), COALESCE($6::bytea, ''::bytea), $7::jsonb)
ON CONFLICT (consumer, topic, uuid) WHERE replay_requested_at IS NULL DO NOTHING`
}

// mysqlDeadLetter is pgDeadLetter for the MySQL dead-letter table.
func mysqlDeadLetter(names sqlschema.Names) string {
	return "INSERT INTO " + names.DLQ + " (uuid, topic, dlq_topic, consumer, `key`, `error`, permanent,\n" +
		"    first_failed_at, last_failed_at, payload, metadata, dead_at)\n" +
		"VALUES (?, ?, '', ?, ?, ?, TRUE, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6), ?, ?, UTC_TIMESTAMP(6))\n" +
		"ON DUPLICATE KEY UPDATE id = id"
}

// pgUnledger deletes the ledger record that the take statement wrote for a
// refused row (arguments: uuid, topic), when the relay keeps a ledger: the
// row was dead-lettered, not published. The take's records are the ones
// of this transaction, published_at now().
func pgUnledger(names sqlschema.Names, ledger bool) string {
	if !ledger {
		return ""
	}
	return `DELETE FROM ` + names.Ledger + ` WHERE uuid = $1 AND topic = $2 AND published_at = now()`
}
