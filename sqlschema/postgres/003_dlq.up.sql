-- The dead-letter queue: one row per message a consumer gave up on,
-- written by dlq.Publisher and read, replayed and purged by dlq.Store and
-- the oncemill command. The columns are parsed from the oncemill_dlq_*
-- metadata the poison middleware adds; a field that is missing or garbled
-- is stored as NULL (times, Kafka position) or as the column's zero value.
-- metadata holds the full metadata as published, oncemill_dlq_* included.
CREATE TABLE IF NOT EXISTS {{.DLQ}} (
    id              bigserial   PRIMARY KEY,
    uuid            text        NOT NULL,
    topic           text        NOT NULL DEFAULT '',
    dlq_topic       text        NOT NULL DEFAULT '',
    consumer        text        NOT NULL DEFAULT '',
    key             text        NOT NULL DEFAULT '',
    attempts        integer     NOT NULL DEFAULT 0,
    error           text        NOT NULL DEFAULT '',
    permanent       boolean     NOT NULL DEFAULT false,
    first_failed_at timestamptz,
    last_failed_at  timestamptz,
    kafka_partition integer,
    kafka_offset    bigint,
    payload         bytea       NOT NULL DEFAULT '',
    metadata        jsonb       NOT NULL DEFAULT '{}',
    dead_at         timestamptz NOT NULL DEFAULT now()
);

-- Listing is ordered by id; these serve the filters on the original
-- topic, the consumer and the time of death.
CREATE INDEX IF NOT EXISTS "{{.DLQName}}_dead_at_idx" ON {{.DLQ}} (dead_at);
CREATE INDEX IF NOT EXISTS "{{.DLQName}}_topic_idx" ON {{.DLQ}} (topic, id);
CREATE INDEX IF NOT EXISTS "{{.DLQName}}_consumer_idx" ON {{.DLQ}} (consumer, id);
