-- One entry per message and consumer, enforced by the database: 007's
-- check (NOT EXISTS before the insert) cannot see a concurrent writer's
-- uncommitted row, so two writers dead-lettering the same message at once
-- without an inbox (two consumers of one group, a redelivery racing the
-- first copy) both wrote it. dlq.Publisher now inserts with
-- ON CONFLICT … DO NOTHING against this index. An entry whose replay was
-- requested is outside it, so that it does not block a new entry while it
-- is on its way back to its consumer.
--
-- Writers are held off while the duplicates already in the table are
-- removed, keeping the oldest entry (lowest id) of each, and the index is
-- built; readers are not.
LOCK TABLE {{.DLQ}} IN SHARE ROW EXCLUSIVE MODE;
DELETE FROM {{.DLQ}} d
USING {{.DLQ}} o
WHERE d.replay_requested_at IS NULL AND o.replay_requested_at IS NULL
    AND o.consumer = d.consumer AND o.topic = d.topic AND o.uuid = d.uuid
    AND o.id < d.id;
CREATE UNIQUE INDEX IF NOT EXISTS "{{.DLQName}}_once_idx" ON {{.DLQ}} (consumer, topic, uuid)
    WHERE replay_requested_at IS NULL;
