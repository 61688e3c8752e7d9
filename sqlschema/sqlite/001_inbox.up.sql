-- The inbox: one row per (consumer, key) that a consumer has claimed.
-- status: 'done' (effect committed), 'failed' (last attempt failed, may be
-- claimed again) or 'processing' (lease mode: held until lease_until).
-- Every timestamp is an INTEGER count of microseconds since the Unix epoch,
-- UTC; the defaults give the current time in the same unit.
CREATE TABLE IF NOT EXISTS {{.Inbox}} (
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

CREATE INDEX IF NOT EXISTS "{{.InboxName}}_expires_at_idx" ON {{.Inbox}} (expires_at);
