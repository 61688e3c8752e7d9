-- The duplicates the up step removed are not restored.
DROP INDEX IF EXISTS {{.Schema}}."{{.DLQName}}_once_idx";
