-- Scheduled outbox rows for MySQL 8.0 or newer and MariaDB 10.6 or newer:
-- what the PostgreSQL migration 011_outbox_scheduled adds. Events written
-- with a due time in the future (forwarder.PublishAt, forwarder.Delay)
-- wait here, not in the outbox; before its takes, the relay moves the rows
-- that are due into the outbox, in (due_at, id) order, in one short
-- transaction, and they go out from there as any outbox row. MySQL does
-- not run DDL in a transaction, so every statement is safe to run again,
-- and each ends with ';' at the end of a line, where the migrator splits
-- the file.
--
-- The columns are the ones the publisher fills in the outbox (binary
-- strings kept byte for byte, created_at and writer as there), and
-- due_at, DATETIME(6) in UTC like every time of oncemill's MySQL tables.
-- The index serves the relay's look for the earliest due time and its
-- take of the due rows.
CREATE TABLE IF NOT EXISTS {{.Scheduled}} (
    id            BIGINT UNSIGNED NOT NULL AUTO_INCREMENT,
    topic         BLOB            NOT NULL,
    uuid          BLOB            NOT NULL,
    partition_key BLOB            NOT NULL,
    payload       LONGBLOB        NULL,
    metadata      LONGBLOB        NOT NULL,
    created_at    DATETIME(6)     NOT NULL,
    writer        BIGINT UNSIGNED NOT NULL DEFAULT 0,
    due_at        DATETIME(6)     NOT NULL,
    PRIMARY KEY (id),
    KEY `{{.OutboxName}}_due_idx` (due_at, id)
) ENGINE = InnoDB ROW_FORMAT = DYNAMIC;
