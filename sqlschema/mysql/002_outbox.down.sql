DROP TABLE IF EXISTS {{.Schema}}.`{{.OutboxName}}_lanes`;
DROP TABLE IF EXISTS {{.Outbox}};
