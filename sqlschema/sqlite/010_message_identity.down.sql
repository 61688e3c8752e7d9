-- Back to one entry and one parked row per (consumer, topic, uuid); fails
-- with a unique violation, changing nothing, while two messages of one
-- UUID are in a table: purge or replay one of them first.
DROP INDEX IF EXISTS "{{.RetriesName}}_once_idx";
CREATE UNIQUE INDEX IF NOT EXISTS "{{.RetriesName}}_once_idx" ON {{.Retries}} (consumer, topic, uuid);
DROP INDEX IF EXISTS "{{.DLQName}}_once_idx";
CREATE UNIQUE INDEX IF NOT EXISTS "{{.DLQName}}_once_idx" ON {{.DLQ}} (consumer, topic, uuid)
    WHERE replay_requested_at IS NULL;
