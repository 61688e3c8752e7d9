-- The relay's ledger: one row per outbox row the relay published, written
-- by the statement that deletes the row from the outbox (so it commits
-- with the delete, once the broker took the message) when
-- forwarder.RelayConfig.Ledger is set, and deleted by the relay once
-- older than RelayConfig.LedgerRetention. `oncemill reconcile` compares
-- it with a consumer's inbox. idempotency_key is the key the inbox's
-- default KeyFunc derives: the idempotency_key metadata, else the UUID.
-- published_at is when the relay took the row, just before publishing it.
CREATE TABLE IF NOT EXISTS {{.Ledger}} (
    uuid            text        NOT NULL,
    topic           text        NOT NULL,
    partition_key   text        NOT NULL,
    idempotency_key text        NOT NULL,
    published_at    timestamptz NOT NULL DEFAULT now()
);

-- The retention's deletes and reconcile's window; reconcile --strict's
-- look-up by key.
CREATE INDEX IF NOT EXISTS "{{.LedgerName}}_published_at_idx" ON {{.Ledger}} (published_at);
CREATE INDEX IF NOT EXISTS "{{.LedgerName}}_key_idx" ON {{.Ledger}} (idempotency_key);
