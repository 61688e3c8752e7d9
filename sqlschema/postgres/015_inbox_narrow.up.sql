-- A narrow inbox row, and the failure state beside it.
--
-- The claim of a new key is the hot path of every delivery: one INSERT in
-- the handler's transaction. Its row held the whole record (attempts,
-- errors, the dead mark's details, the replay grant, created/updated
-- times): columns that only a failure fills, written with defaults on
-- every row. The inbox table keeps what a claim and a duplicate need
-- (status, the stored result, when it was done, when it expires, and a
-- lease's token and end); the failure state moves to a table of its own,
-- written only when an attempt fails, a key is dead-lettered or reopened,
-- a dead copy is counted, or a lease is taken. Its rows go with their
-- key's row (ON DELETE CASCADE), so the sweep and an operator's DELETE
-- need not know of it.
--
-- attempts keeps its meaning: the attempts of the key that claimed it and
-- ended (a failure row's count); a done key without a failure row had
-- one.
CREATE TABLE IF NOT EXISTS {{.InboxFailures}} (
    consumer        text        NOT NULL,
    key             text        NOT NULL,
    attempts        integer     NOT NULL DEFAULT 0,
    first_error     text,
    last_error      text,
    first_failed_at timestamptz,
    last_failed_at  timestamptz,
    dead_at         timestamptz,
    dead_copies     integer     NOT NULL DEFAULT 0,
    replay_grant    text,
    created_at      timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, key),
    CONSTRAINT "{{.InboxName}}_failures_key_fkey" FOREIGN KEY (consumer, key)
        REFERENCES {{.Inbox}} (consumer, key) ON DELETE CASCADE
);

-- Every row with a failure state moves: failed, dead and leased keys, and
-- done keys that failed before, were reopened or had dead copies.
INSERT INTO {{.InboxFailures}} (consumer, key, attempts, first_error, last_error, first_failed_at,
    last_failed_at, dead_at, dead_copies, replay_grant, created_at, updated_at)
SELECT consumer, key, attempts, first_error, last_error, first_failed_at,
    last_failed_at, dead_at, dead_copies, replay_grant, created_at, updated_at
FROM {{.Inbox}}
WHERE status <> 'done' OR attempts <> 1 OR first_failed_at IS NOT NULL OR first_error IS NOT NULL
    OR dead_copies <> 0 OR replay_grant IS NOT NULL
ON CONFLICT (consumer, key) DO NOTHING;

-- Dropping a column only marks it: existing rows keep their bytes until
-- they are rewritten, new rows are narrow. A transactional claim leaves
-- token NULL (no bytes); lease mode sets it.
ALTER TABLE {{.Inbox}}
    DROP COLUMN attempts,
    DROP COLUMN first_error,
    DROP COLUMN last_error,
    DROP COLUMN first_failed_at,
    DROP COLUMN last_failed_at,
    DROP COLUMN created_at,
    DROP COLUMN updated_at,
    DROP COLUMN dead_at,
    DROP COLUMN dead_copies,
    DROP COLUMN replay_grant,
    ALTER COLUMN token DROP NOT NULL,
    ALTER COLUMN token DROP DEFAULT;
