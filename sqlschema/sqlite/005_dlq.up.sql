-- The dead-letter table for SQLite: what the PostgreSQL migrations 003,
-- 005, 007 and 009 add up to, with the same columns. Times are INTEGER
-- microseconds since the Unix epoch, UTC; permanent is 0 or 1; metadata is
-- the full metadata as published, as a JSON object.
--
-- One entry per message and consumer while no replay was requested: the
-- partial unique index once_idx, as on PostgreSQL; dlq.Publisher inserts
-- with ON CONFLICT DO NOTHING.
CREATE TABLE IF NOT EXISTS {{.DLQ}} (
    id                  INTEGER PRIMARY KEY AUTOINCREMENT,
    uuid                TEXT    NOT NULL,
    topic               TEXT    NOT NULL DEFAULT '',
    dlq_topic           TEXT    NOT NULL DEFAULT '',
    consumer            TEXT    NOT NULL DEFAULT '',
    key                 TEXT    NOT NULL DEFAULT '',
    attempts            INTEGER NOT NULL DEFAULT 0,
    error               TEXT    NOT NULL DEFAULT '',
    permanent           INTEGER NOT NULL DEFAULT 0,
    first_failed_at     INTEGER,
    last_failed_at      INTEGER,
    kafka_partition     INTEGER,
    kafka_offset        INTEGER,
    payload             BLOB    NOT NULL DEFAULT x'',
    metadata            TEXT    NOT NULL DEFAULT '{}',
    dead_at             INTEGER NOT NULL DEFAULT (CAST((julianday('now') - 2440587.5) * 86400000000 AS INTEGER)),
    replay_requested_at INTEGER
);

CREATE INDEX IF NOT EXISTS "{{.DLQName}}_dead_at_idx" ON {{.DLQ}} (dead_at);
CREATE INDEX IF NOT EXISTS "{{.DLQName}}_topic_idx" ON {{.DLQ}} (topic, id);
CREATE INDEX IF NOT EXISTS "{{.DLQName}}_consumer_idx" ON {{.DLQ}} (consumer, id);
CREATE INDEX IF NOT EXISTS "{{.DLQName}}_replay_idx" ON {{.DLQ}} (consumer, topic, id)
    WHERE replay_requested_at IS NOT NULL;
CREATE INDEX IF NOT EXISTS "{{.DLQName}}_uuid_idx" ON {{.DLQ}} (consumer, uuid);
CREATE UNIQUE INDEX IF NOT EXISTS "{{.DLQName}}_once_idx" ON {{.DLQ}} (consumer, topic, uuid)
    WHERE replay_requested_at IS NULL;
