ALTER TABLE {{.Inbox}}
    ADD COLUMN IF NOT EXISTS attempts integer NOT NULL DEFAULT 0,
    ADD COLUMN IF NOT EXISTS first_error text,
    ADD COLUMN IF NOT EXISTS last_error text,
    ADD COLUMN IF NOT EXISTS first_failed_at timestamptz,
    ADD COLUMN IF NOT EXISTS last_failed_at timestamptz,
    ADD COLUMN IF NOT EXISTS created_at timestamptz NOT NULL DEFAULT now(),
    ADD COLUMN IF NOT EXISTS updated_at timestamptz NOT NULL DEFAULT now(),
    ADD COLUMN IF NOT EXISTS dead_at timestamptz,
    ADD COLUMN IF NOT EXISTS dead_copies integer NOT NULL DEFAULT 0,
    ADD COLUMN IF NOT EXISTS replay_grant text;

UPDATE {{.Inbox}} SET attempts = 1 WHERE status = 'done';
UPDATE {{.Inbox}} AS i SET attempts = f.attempts, first_error = f.first_error, last_error = f.last_error,
    first_failed_at = f.first_failed_at, last_failed_at = f.last_failed_at, dead_at = f.dead_at,
    dead_copies = f.dead_copies, replay_grant = f.replay_grant, created_at = f.created_at, updated_at = f.updated_at
FROM {{.InboxFailures}} AS f WHERE f.consumer = i.consumer AND f.key = i.key;
UPDATE {{.Inbox}} SET token = 0 WHERE token IS NULL;
ALTER TABLE {{.Inbox}} ALTER COLUMN token SET DEFAULT 0, ALTER COLUMN token SET NOT NULL;

DROP TABLE IF EXISTS {{.InboxFailures}};
