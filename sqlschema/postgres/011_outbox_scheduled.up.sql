-- Scheduled outbox rows: events written with a due time in the future
-- (forwarder.PublishAt, forwarder.Delay) wait here, not in the outbox, so
-- that the relay's takes never walk past them. Before its takes, the relay
-- moves the rows that are due into the outbox, in (due_at, id) order, in
-- one short transaction; from there they go out as any outbox row, after
-- the rows of their key already there. The columns are the ones a writer
-- fills in the outbox, and due_at; created_at is when the row was written
-- (the outbox row gets its own when the relay moves it). The index serves
-- the relay's look for the earliest due time and its take of the due rows.
CREATE TABLE IF NOT EXISTS {{.Scheduled}} (
    id            bigserial   PRIMARY KEY,
    topic         text        NOT NULL,
    uuid          text        NOT NULL,
    partition_key text        NOT NULL,
    payload       bytea,
    metadata      jsonb       NOT NULL DEFAULT '{}',
    created_at    timestamptz NOT NULL DEFAULT now(),
    due_at        timestamptz NOT NULL
);

CREATE INDEX IF NOT EXISTS "{{.OutboxName}}_due_idx" ON {{.Scheduled}} (due_at, id);
