DROP INDEX IF EXISTS {{.Schema}}."{{.DLQName}}_replay_idx";
ALTER TABLE {{.DLQ}} DROP COLUMN IF EXISTS replay_requested_at;
