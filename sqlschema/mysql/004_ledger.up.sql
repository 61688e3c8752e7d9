-- The relay's ledger for MySQL 8.0 or newer and MariaDB 10.6 or newer:
-- what the PostgreSQL migration 010_ledger adds. One row per outbox row
-- the relay published, written in the batch's transaction, which deletes
-- the row from the outbox (so it commits with the delete, once the broker
-- took the message), when forwarder.RelayConfig.Ledger is set, and
-- deleted by the relay once older than RelayConfig.LedgerRetention.
-- idempotency_key is the key the inbox's default KeyFunc derives: the
-- idempotency_key metadata, else the UUID. MySQL does not run DDL in a
-- transaction, so every statement is safe to run again, and each ends
-- with ';' at the end of a line, where the migrator splits the file.
--
-- uuid, topic, partition_key and idempotency_key are binary strings, kept
-- byte for byte as in the outbox. published_at is when the relay took the
-- row, just before publishing it: DATETIME(6) in UTC (UTC_TIMESTAMP(6)),
-- like every time of oncemill's MySQL tables, whatever the session's time
-- zone (go-sql-driver/mysql's parseTime reads it as UTC with its default
-- loc): TIMESTAMP would end in 2038 and follow the session's zone. id, which the PostgreSQL table
-- lacks, is there for servers that require a primary key
-- (sql_require_primary_key) and for row-based replication.
--
-- published_at's index serves the retention's deletes and reconcile's
-- window, idempotency_key's the look-up by key (reconcile --strict); a
-- prefix index, as for any BLOB, which still compares the whole key.
CREATE TABLE IF NOT EXISTS {{.Ledger}} (
    id              BIGINT UNSIGNED NOT NULL AUTO_INCREMENT,
    uuid            BLOB            NOT NULL,
    topic           BLOB            NOT NULL,
    partition_key   BLOB            NOT NULL,
    idempotency_key BLOB            NOT NULL,
    published_at    DATETIME(6)     NOT NULL,
    PRIMARY KEY (id),
    KEY `{{.LedgerName}}_published_at_idx` (published_at),
    KEY `{{.LedgerName}}_key_idx` (idempotency_key(255))
) ENGINE = InnoDB ROW_FORMAT = DYNAMIC;
