-- Dead keys and crash-proof attempt counts.
--
-- status 'dead': the poison middleware dead-lettered the key; later copies
-- are acked without running (dead_copies counts them) until a replay of
-- the dead letter reopens the key.
ALTER TABLE {{.Inbox}} DROP CONSTRAINT IF EXISTS "{{.InboxName}}_status_check";
ALTER TABLE {{.Inbox}} ADD CONSTRAINT "{{.InboxName}}_status_check"
    CHECK (status IN ('processing', 'failed', 'done', 'dead'));
ALTER TABLE {{.Inbox}} ADD COLUMN IF NOT EXISTS dead_at timestamptz;
ALTER TABLE {{.Inbox}} ADD COLUMN IF NOT EXISTS dead_copies integer NOT NULL DEFAULT 0;

-- Lease tokens never repeat for a key, even after the row expired and was
-- deleted: new tokens are taken from this sequence.
CREATE SEQUENCE IF NOT EXISTS {{.Schema}}."{{.InboxName}}_token_seq" AS bigint;

-- Attempts of a transactional-mode key that started and have not
-- committed: written in a statement of its own before the handler's
-- transaction begins, so that an attempt whose process dies is counted;
-- deleted in the transaction that commits the key. UNLOGGED: the write
-- flushes no WAL, so it costs a round trip and no disk sync. Its rows are
-- lost if the database server itself crashes, which only delays a
-- dead-letter.
CREATE UNLOGGED TABLE IF NOT EXISTS {{.InboxStarts}} (
    consumer   text        NOT NULL,
    key        text        NOT NULL,
    started    integer     NOT NULL,
    expires_at timestamptz NOT NULL,
    PRIMARY KEY (consumer, key)
);

CREATE INDEX IF NOT EXISTS "{{.InboxName}}_starts_expires_at_idx" ON {{.InboxStarts}} (expires_at);
