-- Replay grants (see the PostgreSQL migration of the same name): a replay
-- reopens a dead key only for the copy that carries the grant written on
-- the key's row.
ALTER TABLE {{.Inbox}} ADD COLUMN replay_grant TEXT;
