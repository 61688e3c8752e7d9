-- A UUID is not a message's identity: two messages that share one (a
-- producer that reuses UUIDs, `oncemill publish --uuid` given twice) and
-- carry different keys are two messages, and each must be parked and
-- each dead-lettered. Until now the dead-letter table kept one entry per
-- (consumer, topic, uuid) and the table of parked messages one row: the
-- second message was taken for a copy of the first, acked, and lost.
-- Both unique indexes now include the key (the inbox's idempotency key),
-- which is what the inbox tells two messages apart by; a copy of one
-- message, dead-lettered or parked again after its ack was lost, has the
-- same key and is still written once. The writers insert with ON
-- CONFLICT DO NOTHING against whichever unique index the table has.
--
-- No row is removed: the new indexes are finer than the old ones, which
-- the rows already satisfy. The identifiers are stored in their bounded
-- form (at most 512 bytes each), so that the four columns fit an index
-- row.
DROP INDEX IF EXISTS {{.Schema}}."{{.DLQName}}_once_idx";
CREATE UNIQUE INDEX IF NOT EXISTS "{{.DLQName}}_once_idx" ON {{.DLQ}} (consumer, topic, uuid, key)
    WHERE replay_requested_at IS NULL;
DROP INDEX IF EXISTS {{.Schema}}."{{.RetriesName}}_once_idx";
CREATE UNIQUE INDEX IF NOT EXISTS "{{.RetriesName}}_once_idx" ON {{.Retries}} (consumer, topic, uuid, key);
