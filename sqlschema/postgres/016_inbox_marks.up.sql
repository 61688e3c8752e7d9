-- Hand-out marks (delivery.HandOutMarks): for a subscriber whose broker
-- counts no deliveries (Kafka), the highest offset that a consumer
-- group's subscriber may have handed out of a partition, written before
-- any offset under it goes out, one write for a batch of offsets. An
-- offset at or below it, redelivered, may have been handed out to a
-- process that died in it, and has its attempts counted one by one; one
-- above it is a first delivery, whose attempt the inbox need not record.
-- Logged (not UNLOGGED, unlike the start counts): a mark lost with a
-- crash of the server would take a crashed handler's offset for a first
-- delivery.
CREATE TABLE IF NOT EXISTS {{.InboxMarks}} (
    consumer_group  text        NOT NULL,
    topic           text        NOT NULL,
    kafka_partition integer     NOT NULL,
    handed_out      bigint      NOT NULL,
    updated_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer_group, topic, kafka_partition)
);
