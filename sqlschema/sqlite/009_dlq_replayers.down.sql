DROP TABLE IF EXISTS "{{.DLQName}}_replayers";
