-- Back to one entry and one parked row per (consumer, topic, uuid); fails
-- with a duplicate key, changing nothing, while two messages of one UUID
-- are in a table: purge or replay one of them first.
ALTER TABLE {{.Retries}} MODIFY COLUMN once_key BINARY(32) GENERATED ALWAYS AS (
    UNHEX(SHA2(CONCAT(LENGTH(consumer), ':', consumer, ',', LENGTH(topic), ':', topic, ',', uuid), 256))) STORED;
ALTER TABLE {{.DLQ}} MODIFY COLUMN once_key BINARY(32) GENERATED ALWAYS AS (IF(replay_requested_at IS NULL,
    UNHEX(SHA2(CONCAT(LENGTH(consumer), ':', consumer, ',', LENGTH(topic), ':', topic, ',', uuid), 256)), NULL)) STORED;
