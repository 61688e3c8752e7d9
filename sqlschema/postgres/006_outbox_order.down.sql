CREATE INDEX IF NOT EXISTS "{{.OutboxName}}_lane_idx" ON {{.Outbox}} (lane, txid, id);
DROP INDEX IF EXISTS {{.Schema}}."{{.OutboxName}}_lane_id_idx";

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
