-- Replay subscribers that announce themselves: the PostgreSQL migration
-- 013_dlq_replayers, with the same columns. seen_at is INTEGER
-- microseconds since the Unix epoch, UTC.
CREATE TABLE IF NOT EXISTS "{{.DLQName}}_replayers" (
    consumer      TEXT    NOT NULL PRIMARY KEY,
    seen_at       INTEGER NOT NULL,
    beat_every_ms INTEGER NOT NULL
);
