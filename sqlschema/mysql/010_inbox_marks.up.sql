-- Hand-out marks (delivery.HandOutMarks): see the PostgreSQL migration
-- 016_inbox_marks. The group and the topic are stored as the inbox's
-- consumer and key are: byte for byte, a longer value as its digest.
CREATE TABLE IF NOT EXISTS {{.InboxMarks}} (
    consumer_group  VARBINARY(255)  NOT NULL,
    topic           VARBINARY(1024) NOT NULL,
    kafka_partition INT             NOT NULL,
    handed_out      BIGINT          NOT NULL,
    updated_at      DATETIME(6)     NOT NULL,
    PRIMARY KEY (consumer_group, topic, kafka_partition)
) ENGINE = InnoDB ROW_FORMAT = DYNAMIC;
