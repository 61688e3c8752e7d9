ALTER TABLE {{.Inbox}} RENAME TO "{{.InboxName}}_narrow";

CREATE TABLE {{.Inbox}} (
    consumer        TEXT    NOT NULL,
    key             TEXT    NOT NULL,
    status          TEXT    NOT NULL CHECK (status IN ('processing', 'failed', 'done', 'dead')),
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
    dead_at         INTEGER,
    dead_copies     INTEGER NOT NULL DEFAULT 0,
    replay_grant    TEXT,
    PRIMARY KEY (consumer, key)
);

INSERT INTO {{.Inbox}} (consumer, key, status, attempts, token, lease_until, result, first_error, last_error,
    first_failed_at, last_failed_at, created_at, updated_at, done_at, expires_at, dead_at, dead_copies, replay_grant)
SELECT i.consumer, i.key, i.status, COALESCE(f.attempts, CASE WHEN i.status = 'done' THEN 1 ELSE 0 END),
    COALESCE(i.token, 0), i.lease_until, i.result, f.first_error, f.last_error, f.first_failed_at, f.last_failed_at,
    COALESCE(f.created_at, i.done_at, i.expires_at), COALESCE(f.updated_at, i.done_at, i.expires_at), i.done_at,
    i.expires_at, f.dead_at, COALESCE(f.dead_copies, 0), f.replay_grant
FROM "{{.InboxName}}_narrow" AS i LEFT JOIN {{.InboxFailures}} AS f ON f.consumer = i.consumer AND f.key = i.key;

DROP TABLE {{.InboxFailures}};
DROP TABLE "{{.InboxName}}_narrow";
CREATE INDEX IF NOT EXISTS "{{.InboxName}}_expires_at_idx" ON {{.Inbox}} (expires_at);
