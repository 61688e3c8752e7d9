-- Rows leave the outbox in insertion order (id) within a lane, not in
-- transaction-id order: PostgreSQL gives a transaction its id at its first
-- write, so a transaction that wrote something else early and then waited
-- for a business row's lock would have gone out before the writer it
-- waited for. The relay now walks each lane by id.
CREATE INDEX IF NOT EXISTS "{{.OutboxName}}_lane_id_idx" ON {{.Outbox}} (lane, id);
DROP INDEX IF EXISTS {{.Schema}}."{{.OutboxName}}_lane_idx";

-- No wake-up on the writers' commit path: pg_notify takes PostgreSQL's
-- global notify-queue lock at commit, which serialised every outbox
-- writer's commit. The relay polls adaptively instead.
DROP TRIGGER IF EXISTS "{{.OutboxName}}_notify" ON {{.Outbox}};
DROP FUNCTION IF EXISTS {{.Schema}}."{{.OutboxName}}_notify"();
