-- The dead-letter queue for MySQL 8.0 or newer and MariaDB 10.6 or newer,
-- in one step: what the PostgreSQL migrations 003, 005, 007 and 009 add
-- up to. One row per message a consumer gave up on, written by
-- dlq.Publisher (dlq.NewSQLPublisher) and read, replayed and purged by
-- dlq.Store (dlq.NewSQLStore) and the oncemill command. MySQL does not run
-- DDL in a transaction, so every statement is safe to run again, and each
-- ends with ';' at the end of a line, where the migrator splits the file.
--
-- The columns are parsed from the oncemill_dlq_* metadata the poison
-- middleware adds; a field that is missing or garbled is stored as NULL
-- (times, Kafka position) or as the column's zero value. metadata holds
-- the full metadata as published, oncemill_dlq_* included, as JSON.
-- uuid, topic, dlq_topic, consumer and key are binary strings, compared
-- byte for byte (a _ci or PAD SPACE collation would take two consumers
-- that differ in case or trailing spaces for one); error is text, so that
-- it can be searched ignoring case. Times are DATETIME(6) in UTC.
--
-- replay_requested_at marks an entry for a replay to its own consumer
-- (oncemill dlq replay --to-consumer, dlq.Store.RequestReplay), which the
-- consumer's dlq.ReplaySubscriber delivers and deletes once handled.
--
-- One entry per message and consumer, enforced by the database: once_key
-- is a digest of (consumer, topic, uuid), NULL once the entry's replay was
-- requested, and it is unique, so dlq.Publisher inserts with ON DUPLICATE
-- KEY UPDATE that changes nothing: a copy dead-lettered again (its ack was
-- lost to a crash or a rebalance), or by two writers at once, is written
-- once; a second writer waits for the first's commit and then writes
-- nothing. MySQL has no partial index; a unique index allows any number of
-- NULLs, which leaves the entries on their way back out of it. The digest
-- spells each part's length, so that no two triples give one string, and
-- stands for columns too long to index whole.
CREATE TABLE IF NOT EXISTS {{.DLQ}} (
    id                  BIGINT      NOT NULL AUTO_INCREMENT,
    uuid                BLOB        NOT NULL,
    topic               BLOB        NOT NULL,
    dlq_topic           BLOB        NOT NULL,
    consumer            BLOB        NOT NULL,
    `key`               BLOB        NOT NULL,
    attempts            INT         NOT NULL DEFAULT 0,
    error               LONGTEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    permanent           BOOLEAN     NOT NULL DEFAULT FALSE,
    first_failed_at     DATETIME(6) NULL,
    last_failed_at      DATETIME(6) NULL,
    kafka_partition     INT         NULL,
    kafka_offset        BIGINT      NULL,
    payload             LONGBLOB    NOT NULL,
    metadata            LONGTEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    dead_at             DATETIME(6) NOT NULL,
    replay_requested_at DATETIME(6) NULL,
    once_key            BINARY(32)  GENERATED ALWAYS AS (IF(replay_requested_at IS NULL,
        UNHEX(SHA2(CONCAT(LENGTH(consumer), ':', consumer, ',', LENGTH(topic), ':', topic, ',', uuid), 256)), NULL)) STORED,
    PRIMARY KEY (id),
    UNIQUE KEY `{{.DLQName}}_once_idx` (once_key),
    KEY `{{.DLQName}}_dead_at_idx` (dead_at),
    KEY `{{.DLQName}}_topic_idx` (topic(255), id),
    KEY `{{.DLQName}}_consumer_idx` (consumer(255), topic(255), id)
) ENGINE = InnoDB ROW_FORMAT = DYNAMIC;
