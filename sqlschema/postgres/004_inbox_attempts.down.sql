DROP TABLE IF EXISTS {{.InboxStarts}};
DROP SEQUENCE IF EXISTS {{.Schema}}."{{.InboxName}}_token_seq";
DELETE FROM {{.Inbox}} WHERE status = 'dead';
ALTER TABLE {{.Inbox}} DROP COLUMN IF EXISTS dead_copies;
ALTER TABLE {{.Inbox}} DROP COLUMN IF EXISTS dead_at;
ALTER TABLE {{.Inbox}} DROP CONSTRAINT IF EXISTS "{{.InboxName}}_status_check";
ALTER TABLE {{.Inbox}} ADD CONSTRAINT "{{.InboxName}}_status_check"
    CHECK (status IN ('processing', 'failed', 'done'));
