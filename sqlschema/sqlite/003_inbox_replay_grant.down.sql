ALTER TABLE {{.Inbox}} DROP COLUMN replay_grant;
