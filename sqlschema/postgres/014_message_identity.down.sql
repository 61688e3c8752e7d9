-- Back to one entry and one parked row per (consumer, topic, uuid). Two
-- messages of one UUID written since cannot both stay under it: the
-- CREATE then fails with a unique violation that names the index, and
-- nothing changes; purge or replay one of them first.
DROP INDEX IF EXISTS {{.Schema}}."{{.RetriesName}}_once_idx";
CREATE UNIQUE INDEX IF NOT EXISTS "{{.RetriesName}}_once_idx" ON {{.Retries}} (consumer, topic, uuid);
DROP INDEX IF EXISTS {{.Schema}}."{{.DLQName}}_once_idx";
CREATE UNIQUE INDEX IF NOT EXISTS "{{.DLQName}}_once_idx" ON {{.DLQ}} (consumer, topic, uuid)
    WHERE replay_requested_at IS NULL;
