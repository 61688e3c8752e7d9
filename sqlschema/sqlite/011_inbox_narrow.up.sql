-- A narrow inbox row, and the failure state beside it: see the PostgreSQL
-- migration 015_inbox_narrow. SQLite drops a column by rewriting the
-- table, so the table is rebuilt: renamed, created narrow, its rows
-- copied, and the failure table filled from the old one before it is
-- dropped (no foreign key points at the old table, so dropping it
-- deletes nothing else). The failure table's rows go with their key's
-- row when foreign keys are on (sqlite.Open turns them on); the store's
-- sweep deletes them itself.
ALTER TABLE {{.Inbox}} RENAME TO "{{.InboxName}}_wide";

CREATE TABLE {{.Inbox}} (
    consumer    TEXT    NOT NULL,
    key         TEXT    NOT NULL,
    status      TEXT    NOT NULL CHECK (status IN ('processing', 'failed', 'done', 'dead')),
    token       INTEGER,
    lease_until INTEGER,
    result      BLOB,
    done_at     INTEGER,
    expires_at  INTEGER NOT NULL,
    PRIMARY KEY (consumer, key)
);

INSERT INTO {{.Inbox}} (consumer, key, status, token, lease_until, result, done_at, expires_at)
SELECT consumer, key, status, NULLIF(token, 0), lease_until, result, done_at, expires_at FROM "{{.InboxName}}_wide";

CREATE TABLE {{.InboxFailures}} (
    consumer        TEXT    NOT NULL,
    key             TEXT    NOT NULL,
    attempts        INTEGER NOT NULL DEFAULT 0,
    first_error     TEXT,
    last_error      TEXT,
    first_failed_at INTEGER,
    last_failed_at  INTEGER,
    dead_at         INTEGER,
    dead_copies     INTEGER NOT NULL DEFAULT 0,
    replay_grant    TEXT,
    created_at      INTEGER NOT NULL,
    updated_at      INTEGER NOT NULL,
    PRIMARY KEY (consumer, key),
    FOREIGN KEY (consumer, key) REFERENCES {{.Inbox}} (consumer, key) ON DELETE CASCADE
);

INSERT INTO {{.InboxFailures}} (consumer, key, attempts, first_error, last_error, first_failed_at,
    last_failed_at, dead_at, dead_copies, replay_grant, created_at, updated_at)
SELECT consumer, key, attempts, first_error, last_error, first_failed_at,
    last_failed_at, dead_at, dead_copies, replay_grant, created_at, updated_at
FROM "{{.InboxName}}_wide"
WHERE status <> 'done' OR attempts <> 1 OR first_failed_at IS NOT NULL OR first_error IS NOT NULL
    OR dead_copies <> 0 OR replay_grant IS NOT NULL;

DROP TABLE "{{.InboxName}}_wide";
CREATE INDEX IF NOT EXISTS "{{.InboxName}}_expires_at_idx" ON {{.Inbox}} (expires_at);
