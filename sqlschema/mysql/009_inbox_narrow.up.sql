-- A narrow inbox row, and the failure state beside it: see the PostgreSQL
-- migration 015_inbox_narrow. The failure table's rows go with their
-- key's row (ON DELETE CASCADE).
--
-- Every statement is safe to run again, as the migrator requires of a
-- MySQL step (DDL is not transactional): the copy and the ALTER TABLE,
-- which read and drop the wide row's columns, run only while the inbox
-- table still has them, as statements prepared from a session variable
-- (MySQL has no DROP COLUMN IF EXISTS).
CREATE TABLE IF NOT EXISTS {{.InboxFailures}} (
    consumer        VARBINARY(255)  NOT NULL,
    `key`           VARBINARY(1024) NOT NULL,
    attempts        INT             NOT NULL DEFAULT 0,
    first_error     TEXT CHARACTER SET utf8mb4 NULL,
    last_error      TEXT CHARACTER SET utf8mb4 NULL,
    first_failed_at DATETIME(6)     NULL,
    last_failed_at  DATETIME(6)     NULL,
    dead_at         DATETIME(6)     NULL,
    dead_copies     INT             NOT NULL DEFAULT 0,
    replay_grant    VARBINARY(255)  NULL,
    created_at      DATETIME(6)     NOT NULL,
    updated_at      DATETIME(6)     NOT NULL,
    PRIMARY KEY (consumer, `key`),
    CONSTRAINT `{{.InboxName}}_failures_key_fkey` FOREIGN KEY (consumer, `key`)
        REFERENCES {{.Inbox}} (consumer, `key`) ON DELETE CASCADE
) ENGINE = InnoDB ROW_FORMAT = DYNAMIC;

SET @oncemill_wide := (SELECT COUNT(*) FROM information_schema.COLUMNS
    WHERE TABLE_SCHEMA = TRIM(BOTH '`' FROM '{{.Schema}}') AND TABLE_NAME = '{{.InboxName}}' AND COLUMN_NAME = 'replay_grant');

SET @oncemill_step := IF(@oncemill_wide > 0, 'INSERT IGNORE INTO {{.InboxFailures}} (consumer, `key`, attempts, first_error, last_error, first_failed_at,
    last_failed_at, dead_at, dead_copies, replay_grant, created_at, updated_at)
SELECT consumer, `key`, attempts, first_error, last_error, first_failed_at,
    last_failed_at, dead_at, dead_copies, replay_grant, created_at, updated_at
FROM {{.Inbox}}
WHERE status <> ''done'' OR attempts <> 1 OR first_failed_at IS NOT NULL OR first_error IS NOT NULL
    OR dead_copies <> 0 OR replay_grant IS NOT NULL', 'DO 0');
PREPARE oncemill_step FROM @oncemill_step;
EXECUTE oncemill_step;
DEALLOCATE PREPARE oncemill_step;

SET @oncemill_step := IF(@oncemill_wide > 0, 'ALTER TABLE {{.Inbox}}
    DROP COLUMN attempts,
    DROP COLUMN first_error,
    DROP COLUMN last_error,
    DROP COLUMN first_failed_at,
    DROP COLUMN last_failed_at,
    DROP COLUMN created_at,
    DROP COLUMN updated_at,
    DROP COLUMN dead_at,
    DROP COLUMN dead_copies,
    DROP COLUMN replay_grant', 'DO 0');
PREPARE oncemill_step FROM @oncemill_step;
EXECUTE oncemill_step;
DEALLOCATE PREPARE oncemill_step;

-- A transactional claim leaves token NULL; lease mode sets it.
ALTER TABLE {{.Inbox}} MODIFY token BIGINT NULL DEFAULT NULL;
