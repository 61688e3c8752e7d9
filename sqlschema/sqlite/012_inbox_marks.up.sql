-- Hand-out marks (delivery.HandOutMarks): see the PostgreSQL migration
-- 016_inbox_marks.
CREATE TABLE IF NOT EXISTS {{.InboxMarks}} (
    consumer_group  TEXT    NOT NULL,
    topic           TEXT    NOT NULL,
    kafka_partition INTEGER NOT NULL,
    handed_out      INTEGER NOT NULL,
    updated_at      INTEGER NOT NULL,
    PRIMARY KEY (consumer_group, topic, kafka_partition)
);
