-- A UUID is not a message's identity: the PostgreSQL migration
-- 014_message_identity. The unique indexes of the dead-letter table and
-- of the table of parked messages include the key, so that two messages
-- of one UUID with different keys are each dead-lettered and each
-- parked, while a copy of one message is still written once. No row is
-- removed: the new indexes are finer than the old ones.
DROP INDEX IF EXISTS "{{.DLQName}}_once_idx";
CREATE UNIQUE INDEX IF NOT EXISTS "{{.DLQName}}_once_idx" ON {{.DLQ}} (consumer, topic, uuid, key)
    WHERE replay_requested_at IS NULL;
DROP INDEX IF EXISTS "{{.RetriesName}}_once_idx";
CREATE UNIQUE INDEX IF NOT EXISTS "{{.RetriesName}}_once_idx" ON {{.Retries}} (consumer, topic, uuid, key);
