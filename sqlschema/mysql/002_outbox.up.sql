-- The outbox for MySQL 8.0 or newer and MariaDB 10.6 or newer: events
-- written in the business transaction (forwarder.NewSQLTxPublisher),
-- relayed to a broker afterwards by forwarder.Relay. MySQL does not run
-- DDL in a transaction, so every statement is safe to run again, and each
-- ends with ';' at the end of a line, where the migrator splits the file.
--
-- id is the insert order: AUTO_INCREMENT hands ids out in the order the
-- inserts ask for them, a transaction's rows in its insert order, and a
-- row inserted after another transaction committed gets a higher id than
-- that transaction's rows. An id can become visible after a higher one
-- (its transaction commits later); the relay keeps no cursor, so a row
-- that commits late is still the lowest of its lane and goes next.
--
-- lane (a hash of the partition key) lets several relays work at once
-- while each key's rows stay with one relay at a time. topic, uuid and
-- partition_key are binary strings, kept byte for byte; metadata is the
-- message's metadata as JSON. created_at is UTC (UTC_TIMESTAMP(6)),
-- whatever the session's time zone. writer is the writing session's
-- CONNECTION_ID(): while the row is uncommitted and holds back the rows
-- behind it in its lane, the relay can say which session to look at (the
-- counterpart of PostgreSQL's txid column); 0 when the row was written
-- by other means.
CREATE TABLE IF NOT EXISTS {{.Outbox}} (
    id            BIGINT UNSIGNED NOT NULL AUTO_INCREMENT,
    topic         BLOB            NOT NULL,
    uuid          BLOB            NOT NULL,
    partition_key BLOB            NOT NULL,
    lane          SMALLINT        GENERATED ALWAYS AS (CRC32(partition_key) & 63) STORED,
    payload       LONGBLOB        NULL,
    metadata      LONGBLOB        NOT NULL,
    created_at    DATETIME(6)     NOT NULL,
    writer        BIGINT UNSIGNED NOT NULL DEFAULT 0,
    PRIMARY KEY (id),
    KEY `{{.OutboxName}}_lane_id_idx` (lane, id)
) ENGINE = InnoDB ROW_FORMAT = DYNAMIC;

-- One row per lane: a relay takes a lane by locking its row (SELECT …
-- FOR UPDATE SKIP LOCKED) until its batch commits or rolls back, the
-- MySQL counterpart of PostgreSQL's transaction-level advisory locks. A
-- relay that dies loses the lock with its session. Writers never touch
-- this table: their commit path takes no lock of the relay's.
CREATE TABLE IF NOT EXISTS {{.Schema}}.`{{.OutboxName}}_lanes` (
    lane SMALLINT NOT NULL,
    PRIMARY KEY (lane)
) ENGINE = InnoDB;

INSERT INTO {{.Schema}}.`{{.OutboxName}}_lanes` (lane) VALUES
    (0), (1), (2), (3), (4), (5), (6), (7), (8), (9), (10), (11), (12), (13), (14), (15),
    (16), (17), (18), (19), (20), (21), (22), (23), (24), (25), (26), (27), (28), (29), (30), (31),
    (32), (33), (34), (35), (36), (37), (38), (39), (40), (41), (42), (43), (44), (45), (46), (47),
    (48), (49), (50), (51), (52), (53), (54), (55), (56), (57), (58), (59), (60), (61), (62), (63)
ON DUPLICATE KEY UPDATE lane = lane;
