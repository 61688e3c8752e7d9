ALTER TABLE {{.Inbox}}
    ADD COLUMN attempts INT NOT NULL DEFAULT 0,
    ADD COLUMN first_error TEXT CHARACTER SET utf8mb4 NULL,
    ADD COLUMN last_error TEXT CHARACTER SET utf8mb4 NULL,
    ADD COLUMN first_failed_at DATETIME(6) NULL,
    ADD COLUMN last_failed_at DATETIME(6) NULL,
    ADD COLUMN created_at DATETIME(6) NOT NULL DEFAULT '1970-01-01 00:00:00',
    ADD COLUMN updated_at DATETIME(6) NOT NULL DEFAULT '1970-01-01 00:00:00',
    ADD COLUMN dead_at DATETIME(6) NULL,
    ADD COLUMN dead_copies INT NOT NULL DEFAULT 0,
    ADD COLUMN replay_grant VARBINARY(255) NULL;
UPDATE {{.Inbox}} SET attempts = 1, created_at = COALESCE(done_at, expires_at), updated_at = COALESCE(done_at, expires_at) WHERE status = 'done';
UPDATE {{.Inbox}} AS i JOIN {{.InboxFailures}} AS f ON f.consumer = i.consumer AND f.`key` = i.`key`
SET i.attempts = f.attempts, i.first_error = f.first_error, i.last_error = f.last_error,
    i.first_failed_at = f.first_failed_at, i.last_failed_at = f.last_failed_at, i.dead_at = f.dead_at,
    i.dead_copies = f.dead_copies, i.replay_grant = f.replay_grant, i.created_at = f.created_at, i.updated_at = f.updated_at;
UPDATE {{.Inbox}} SET token = 0 WHERE token IS NULL;
ALTER TABLE {{.Inbox}} MODIFY token BIGINT NOT NULL DEFAULT 0;
DROP TABLE IF EXISTS {{.InboxFailures}};
