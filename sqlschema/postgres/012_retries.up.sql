-- Parked messages: a message whose attempts failed and that waits, off the
-- consumer, for a delayed retry (package retry). The poison middleware
-- parks it (payload, metadata, key, attempt count, last error) and then
-- acks the original; the consumer's retry subscriber hands it back to the
-- same handler when due_at has passed, and deletes it once the handler
-- acked it. A message of an ordering key (order_key) that has messages
-- parked is parked behind them (behind: it did not fail itself), and a
-- message is handed back only when no message of its key was parked
-- before it (lower id): per-key order holds while one waits.
--
-- One row per message and consumer (once_idx): a copy parked again, its
-- ack lost to a crash, is written once. leased_until is set while a copy
-- is out to the handler, and version grows with every lease and every
-- re-park, so that the ack of a copy deletes only the row it was handed.
CREATE TABLE IF NOT EXISTS {{.Retries}} (
    id              bigserial   PRIMARY KEY,
    consumer        text        NOT NULL,
    topic           text        NOT NULL,
    uuid            text        NOT NULL,
    key             text        NOT NULL DEFAULT '',
    order_key       text,
    attempts        integer     NOT NULL DEFAULT 0,
    error           text        NOT NULL DEFAULT '',
    behind          boolean     NOT NULL DEFAULT false,
    first_failed_at timestamptz,
    last_failed_at  timestamptz,
    due_at          timestamptz NOT NULL,
    parked_at       timestamptz NOT NULL DEFAULT now(),
    leased_until    timestamptz,
    version         bigint      NOT NULL DEFAULT 0,
    payload         bytea       NOT NULL DEFAULT '',
    metadata        jsonb       NOT NULL DEFAULT '{}'
);

CREATE UNIQUE INDEX IF NOT EXISTS "{{.RetriesName}}_once_idx" ON {{.Retries}} (consumer, topic, uuid);
CREATE INDEX IF NOT EXISTS "{{.RetriesName}}_due_idx" ON {{.Retries}} (consumer, topic, due_at, id);
CREATE INDEX IF NOT EXISTS "{{.RetriesName}}_order_idx" ON {{.Retries}} (consumer, topic, order_key, id)
    WHERE order_key IS NOT NULL;
