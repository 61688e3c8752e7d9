-- Replay subscribers that announce themselves: the PostgreSQL migration
-- 013_dlq_replayers, with the same columns. consumer is the bounded form
-- the dead-letter table holds (at most 512 bytes), compared byte for byte;
-- seen_at is DATETIME(6) in UTC.
CREATE TABLE IF NOT EXISTS {{.Schema}}.`{{.DLQName}}_replayers` (
    consumer      VARBINARY(512) NOT NULL,
    seen_at       DATETIME(6)    NOT NULL,
    beat_every_ms BIGINT         NOT NULL,
    PRIMARY KEY (consumer)
) ENGINE = InnoDB;
