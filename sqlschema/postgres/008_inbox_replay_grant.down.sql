ALTER TABLE {{.Inbox}} DROP COLUMN IF EXISTS replay_grant;
