-- The relay's ledger for SQLite: what the PostgreSQL migration 010_ledger
-- adds. One row per outbox row the relay published, written in the
-- transaction that deletes the row, when forwarder.RelayConfig.Ledger is
-- set. published_at is microseconds since the Unix epoch, UTC.
CREATE TABLE IF NOT EXISTS {{.Ledger}} (
    uuid            TEXT    NOT NULL,
    topic           TEXT    NOT NULL,
    partition_key   TEXT    NOT NULL,
    idempotency_key TEXT    NOT NULL,
    published_at    INTEGER NOT NULL DEFAULT (CAST((julianday('now') - 2440587.5) * 86400000000 AS INTEGER))
);

CREATE INDEX IF NOT EXISTS "{{.LedgerName}}_published_at_idx" ON {{.Ledger}} (published_at);
CREATE INDEX IF NOT EXISTS "{{.LedgerName}}_key_idx" ON {{.Ledger}} (idempotency_key);
