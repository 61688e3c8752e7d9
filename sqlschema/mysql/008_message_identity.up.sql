-- A UUID is not a message's identity: the PostgreSQL migration
-- 014_message_identity for MySQL 8.0 or newer and MariaDB 10.6 or newer.
-- The digests that the unique indexes hold (once_key of the dead-letter
-- table and of the table of parked messages) now cover the key too, each
-- part's length spelled, so that two messages of one UUID with different
-- keys are each dead-lettered and each parked, while a copy of one
-- message is still written once. The server computes the new digests of
-- the rows already there; none is removed (the new digests are finer
-- than the old ones). MySQL does not run DDL in a transaction: each
-- statement is safe to run again, and ends with ';' at the end of a line,
-- where the migrator splits the file.
ALTER TABLE {{.DLQ}} MODIFY COLUMN once_key BINARY(32) GENERATED ALWAYS AS (IF(replay_requested_at IS NULL,
    UNHEX(SHA2(CONCAT(LENGTH(consumer), ':', consumer, ',', LENGTH(topic), ':', topic, ',', LENGTH(uuid), ':', uuid, ',', `key`), 256)), NULL)) STORED;
ALTER TABLE {{.Retries}} MODIFY COLUMN once_key BINARY(32) GENERATED ALWAYS AS (
    UNHEX(SHA2(CONCAT(LENGTH(consumer), ':', consumer, ',', LENGTH(topic), ':', topic, ',', LENGTH(uuid), ':', uuid, ',', `key`), 256))) STORED;
