-- The inbox: one row per (consumer, key) that a consumer has claimed.
-- status: 'done' (effect committed), 'failed' (last attempt failed, may be
-- claimed again) or 'processing' (lease mode: held until lease_until).
CREATE TABLE IF NOT EXISTS {{.Inbox}} (
    consumer        text        NOT NULL,
    key             text        NOT NULL,
    status          text        NOT NULL CHECK (status IN ('processing', 'failed', 'done')),
    attempts        integer     NOT NULL DEFAULT 0,
    token           bigint      NOT NULL DEFAULT 0,
    lease_until     timestamptz,
    result          bytea,
    first_error     text,
    last_error      text,
    first_failed_at timestamptz,
    last_failed_at  timestamptz,
    created_at      timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now(),
    done_at         timestamptz,
    expires_at      timestamptz NOT NULL,
    PRIMARY KEY (consumer, key)
);

CREATE INDEX IF NOT EXISTS "{{.InboxName}}_expires_at_idx" ON {{.Inbox}} (expires_at);
