-- Scheduled outbox rows for SQLite: what the PostgreSQL migration
-- 011_outbox_scheduled adds. Events written with a due time in the future
-- (forwarder.PublishAt, forwarder.Delay) wait here, not in the outbox;
-- before its takes, the relay moves the rows that are due into the
-- outbox, in (due_at, id) order, in one short write transaction, and they
-- go out from there as any outbox row. The columns are the ones the
-- publisher fills in the outbox (lane as there), and due_at; times are
-- microseconds since the Unix epoch, UTC.
CREATE TABLE IF NOT EXISTS {{.Scheduled}} (
    id            INTEGER PRIMARY KEY AUTOINCREMENT,
    topic         TEXT    NOT NULL,
    uuid          TEXT    NOT NULL,
    partition_key TEXT    NOT NULL,
    lane          INTEGER NOT NULL DEFAULT 0,
    payload       BLOB,
    metadata      TEXT    NOT NULL DEFAULT '{}',
    created_at    INTEGER NOT NULL DEFAULT (CAST((julianday('now') - 2440587.5) * 86400000000 AS INTEGER)),
    due_at        INTEGER NOT NULL
);

CREATE INDEX IF NOT EXISTS "{{.OutboxName}}_due_idx" ON {{.Scheduled}} (due_at, id);
