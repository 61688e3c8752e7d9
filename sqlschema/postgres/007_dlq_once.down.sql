DROP INDEX IF EXISTS {{.Schema}}."{{.DLQName}}_uuid_idx";
