-- The outbox for SQLite: events written in the business transaction
-- (forwarder.NewSQLTxPublisher), relayed to a broker afterwards by
-- forwarder.Relay. SQLite has one writer at a time and hands out
-- AUTOINCREMENT ids in commit order, so a row can never be overtaken by one
-- with a lower id: the relay walks the table by id and needs no snapshot.
--
-- lane is crc32(partition_key) & 63 (IEEE, as MySQL's CRC32), written by
-- the publisher; SQLite has no CRC function for a generated column. A row
-- written by other means may leave it at 0: one relay walks every lane.
-- metadata is the message's metadata as a JSON object; created_at is
-- microseconds since the Unix epoch, UTC, like every time of oncemill's
-- SQLite tables.
CREATE TABLE IF NOT EXISTS {{.Outbox}} (
    id            INTEGER PRIMARY KEY AUTOINCREMENT,
    topic         TEXT    NOT NULL,
    uuid          TEXT    NOT NULL,
    partition_key TEXT    NOT NULL,
    lane          INTEGER NOT NULL DEFAULT 0,
    payload       BLOB,
    metadata      TEXT    NOT NULL DEFAULT '{}',
    created_at    INTEGER NOT NULL DEFAULT (CAST((julianday('now') - 2440587.5) * 86400000000 AS INTEGER))
);

CREATE INDEX IF NOT EXISTS "{{.OutboxName}}_lane_id_idx" ON {{.Outbox}} (lane, id);
