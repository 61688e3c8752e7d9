-- Replays to the entry's own consumer: `oncemill dlq replay --to-consumer`
-- (dlq.Store.RequestReplay) marks an entry, and the consumer's
-- dlq.ReplaySubscriber delivers it to that consumer only, deleting it once
-- the consumer acked it. Other consumers of the topic never see it.
ALTER TABLE {{.DLQ}} ADD COLUMN IF NOT EXISTS replay_requested_at timestamptz;
CREATE INDEX IF NOT EXISTS "{{.DLQName}}_replay_idx" ON {{.DLQ}} (consumer, topic, id)
    WHERE replay_requested_at IS NOT NULL;
