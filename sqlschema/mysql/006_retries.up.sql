-- Parked messages for MySQL 8.0 or newer and MariaDB 10.6 or newer: the
-- PostgreSQL migration 012_retries, with the same columns. consumer,
-- topic, uuid, key and order_key are binary strings, compared byte for
-- byte; times are DATETIME(6) in UTC. One row per message and consumer:
-- once_key is a digest of (consumer, topic, uuid), each part's length
-- spelled, and unique (MySQL cannot index BLOBs whole). The ordering and
-- due indexes are prefix indexes, which still compare whole values.
-- MySQL does not run DDL in a transaction, so every statement is safe to
-- run again, and each ends with ';' at the end of a line, where the
-- migrator splits the file.
CREATE TABLE IF NOT EXISTS {{.Retries}} (
    id              BIGINT      NOT NULL AUTO_INCREMENT,
    consumer        BLOB        NOT NULL,
    topic           BLOB        NOT NULL,
    uuid            BLOB        NOT NULL,
    `key`           BLOB        NOT NULL,
    order_key       BLOB        NULL,
    attempts        INT         NOT NULL DEFAULT 0,
    error           LONGTEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    behind          BOOLEAN     NOT NULL DEFAULT FALSE,
    first_failed_at DATETIME(6) NULL,
    last_failed_at  DATETIME(6) NULL,
    due_at          DATETIME(6) NOT NULL,
    parked_at       DATETIME(6) NOT NULL,
    leased_until    DATETIME(6) NULL,
    version         BIGINT      NOT NULL DEFAULT 0,
    payload         LONGBLOB    NOT NULL,
    metadata        LONGTEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    once_key        BINARY(32)  GENERATED ALWAYS AS (
        UNHEX(SHA2(CONCAT(LENGTH(consumer), ':', consumer, ',', LENGTH(topic), ':', topic, ',', uuid), 256))) STORED,
    PRIMARY KEY (id),
    UNIQUE KEY `{{.RetriesName}}_once_idx` (once_key),
    KEY `{{.RetriesName}}_due_idx` (consumer(191), topic(191), due_at, id),
    KEY `{{.RetriesName}}_order_idx` (consumer(191), topic(191), order_key(191), id)
) ENGINE = InnoDB ROW_FORMAT = DYNAMIC;
