-- The outbox: events written in the business transaction, relayed to a
-- broker afterwards. txid orders rows in transaction order and lets the
-- relay wait for transactions still in progress; lane (a hash of the
-- partition key) lets several relays work at once while each key's rows
-- stay with one relay at a time.
CREATE TABLE IF NOT EXISTS {{.Outbox}} (
    id            bigserial   PRIMARY KEY,
    txid          xid8        NOT NULL DEFAULT pg_current_xact_id(),
    topic         text        NOT NULL,
    uuid          text        NOT NULL,
    partition_key text        NOT NULL,
    lane          integer     NOT NULL GENERATED ALWAYS AS (hashtext(partition_key) & 63) STORED,
    payload       bytea,
    metadata      jsonb       NOT NULL DEFAULT '{}',
    created_at    timestamptz NOT NULL DEFAULT now()
);

CREATE INDEX IF NOT EXISTS "{{.OutboxName}}_lane_idx" ON {{.Outbox}} (lane, txid, id);

-- One notification per inserting statement, delivered at commit.
CREATE OR REPLACE FUNCTION {{.Schema}}."{{.OutboxName}}_notify"() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('{{.OutboxChannel}}', '');
    RETURN NULL;
END
$$;

DROP TRIGGER IF EXISTS "{{.OutboxName}}_notify" ON {{.Outbox}};
CREATE TRIGGER "{{.OutboxName}}_notify" AFTER INSERT ON {{.Outbox}}
    FOR EACH STATEMENT EXECUTE FUNCTION {{.Schema}}."{{.OutboxName}}_notify"();
