-- Parked messages for SQLite: the PostgreSQL migration 012_retries, with
-- the same columns. Times are INTEGER microseconds since the Unix epoch,
-- UTC; behind is 0 or 1; metadata is a JSON object.
CREATE TABLE IF NOT EXISTS {{.Retries}} (
    id              INTEGER PRIMARY KEY AUTOINCREMENT,
    consumer        TEXT    NOT NULL,
    topic           TEXT    NOT NULL,
    uuid            TEXT    NOT NULL,
    key             TEXT    NOT NULL DEFAULT '',
    order_key       TEXT,
    attempts        INTEGER NOT NULL DEFAULT 0,
    error           TEXT    NOT NULL DEFAULT '',
    behind          INTEGER NOT NULL DEFAULT 0,
    first_failed_at INTEGER,
    last_failed_at  INTEGER,
    due_at          INTEGER NOT NULL,
    parked_at       INTEGER NOT NULL DEFAULT (CAST((julianday('now') - 2440587.5) * 86400000000 AS INTEGER)),
    leased_until    INTEGER,
    version         INTEGER NOT NULL DEFAULT 0,
    payload         BLOB    NOT NULL DEFAULT x'',
    metadata        TEXT    NOT NULL DEFAULT '{}'
);

CREATE UNIQUE INDEX IF NOT EXISTS "{{.RetriesName}}_once_idx" ON {{.Retries}} (consumer, topic, uuid);
CREATE INDEX IF NOT EXISTS "{{.RetriesName}}_due_idx" ON {{.Retries}} (consumer, topic, due_at, id);
CREATE INDEX IF NOT EXISTS "{{.RetriesName}}_order_idx" ON {{.Retries}} (consumer, topic, order_key, id)
    WHERE order_key IS NOT NULL;
