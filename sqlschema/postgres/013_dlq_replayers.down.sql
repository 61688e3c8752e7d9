DROP TABLE IF EXISTS {{.Schema}}."{{.DLQName}}_replayers";
