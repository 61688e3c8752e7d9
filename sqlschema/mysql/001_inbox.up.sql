-- The inbox and its starts table for MySQL 8.0 or newer and MariaDB 10.6
-- or newer, in one step: everything the transactional inbox needs. MySQL
-- does not run DDL in a transaction, so every statement is safe to run
-- again (a migration cut short is applied again from its start), and each
-- statement ends with ';' at the end of a line, where the migrator splits
-- the file.
--
-- consumer and key are VARBINARY: compared byte for byte, so that keys
-- that differ only in case or in trailing spaces, which a _ci or PAD SPACE
-- collation would take for one, stay two keys. Keys longer than the column
-- are stored as their SHA-256 digest by the store, never truncated.
-- Times are DATETIME(6) in UTC (UTC_TIMESTAMP(6)), whatever the session's
-- time zone: TIMESTAMP would end in 2038 and follow the session's zone.
--
-- status: 'done' (effect committed), 'failed' (last attempt failed, may be
-- claimed again), 'dead' (dead-lettered: later copies are acked without
-- running until a replay reopens the key, dead_copies counts them) or
-- 'processing' (lease mode: held until lease_until). replay_grant is the
-- grant a replay must carry to reopen a dead key (see the PostgreSQL
-- migration 008_inbox_replay_grant).
CREATE TABLE IF NOT EXISTS {{.Inbox}} (
    consumer        VARBINARY(255)  NOT NULL,
    `key`           VARBINARY(1024) NOT NULL,
    status          VARCHAR(16) CHARACTER SET ascii NOT NULL,
    attempts        INT             NOT NULL DEFAULT 0,
    token           BIGINT          NOT NULL DEFAULT 0,
    lease_until     DATETIME(6)     NULL,
    result          LONGBLOB        NULL,
    first_error     TEXT CHARACTER SET utf8mb4 NULL,
    last_error      TEXT CHARACTER SET utf8mb4 NULL,
    first_failed_at DATETIME(6)     NULL,
    last_failed_at  DATETIME(6)     NULL,
    created_at      DATETIME(6)     NOT NULL,
    updated_at      DATETIME(6)     NOT NULL,
    done_at         DATETIME(6)     NULL,
    expires_at      DATETIME(6)     NOT NULL,
    dead_at         DATETIME(6)     NULL,
    dead_copies     INT             NOT NULL DEFAULT 0,
    replay_grant    VARBINARY(255)  NULL,
    PRIMARY KEY (consumer, `key`),
    KEY `{{.InboxName}}_expires_at_idx` (expires_at),
    CONSTRAINT `{{.InboxName}}_status_check` CHECK (status IN ('processing', 'failed', 'done', 'dead'))
) ENGINE = InnoDB ROW_FORMAT = DYNAMIC;

-- Attempts of a key that started and have not committed: written in a
-- statement of its own before the handler's transaction begins, so that an
-- attempt whose process dies is counted; deleted in the transaction that
-- commits the key, so that a rollback or a crash keeps the count. It is an
-- InnoDB table like the inbox (MySQL has no UNLOGGED tables, and a MEMORY
-- table would lose the delete's rollback): a start costs a log flush.
CREATE TABLE IF NOT EXISTS {{.InboxStarts}} (
    consumer   VARBINARY(255)  NOT NULL,
    `key`      VARBINARY(1024) NOT NULL,
    started    INT             NOT NULL,
    expires_at DATETIME(6)     NOT NULL,
    PRIMARY KEY (consumer, `key`),
    KEY `{{.InboxName}}_starts_expires_at_idx` (expires_at)
) ENGINE = InnoDB ROW_FORMAT = DYNAMIC;
