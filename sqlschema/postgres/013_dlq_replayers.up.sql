-- Replay subscribers that announce themselves: every dlq.ReplaySubscriber
-- writes its consumer's row when it subscribes and again every
-- beat_every_ms while it runs, so that the console and `oncemill dlq
-- replay --to-consumer` can tell a replay request that will be delivered
-- from one that nobody would pick up. A row is never deleted by the
-- subscriber: seen_at says when the consumer was last alive.
CREATE TABLE IF NOT EXISTS {{.Schema}}."{{.DLQName}}_replayers" (
    consumer      text        PRIMARY KEY,
    seen_at       timestamptz NOT NULL DEFAULT now(),
    beat_every_ms bigint      NOT NULL
);
