DROP TABLE IF EXISTS {{.InboxStarts}};
DELETE FROM {{.Inbox}} WHERE status = 'dead';
CREATE TABLE "{{.InboxName}}_v1" (
    consumer        TEXT    NOT NULL,
    key             TEXT    NOT NULL,
    status          TEXT    NOT NULL CHECK (status IN ('processing', 'failed', 'done')),
    attempts        INTEGER NOT NULL DEFAULT 0,
    token           INTEGER NOT NULL DEFAULT 0,
    lease_until     INTEGER,
    result          BLOB,
    first_error     TEXT,
    last_error      TEXT,
    first_failed_at INTEGER,
    last_failed_at  INTEGER,
    created_at      INTEGER NOT NULL DEFAULT (CAST((julianday('now') - 2440587.5) * 86400000000 AS INTEGER)),
    updated_at      INTEGER NOT NULL DEFAULT (CAST((julianday('now') - 2440587.5) * 86400000000 AS INTEGER)),
    done_at         INTEGER,
    expires_at      INTEGER NOT NULL,
    PRIMARY KEY (consumer, key)
);
INSERT INTO "{{.InboxName}}_v1" SELECT consumer, key, status, attempts, token, lease_until, result,
    first_error, last_error, first_failed_at, last_failed_at, created_at, updated_at, done_at, expires_at
FROM {{.Inbox}};
DROP TABLE {{.Inbox}};
ALTER TABLE "{{.InboxName}}_v1" RENAME TO "{{.InboxName}}";
CREATE INDEX IF NOT EXISTS "{{.InboxName}}_expires_at_idx" ON {{.Inbox}} (expires_at);
