DROP TABLE IF EXISTS {{.Outbox}};
DROP FUNCTION IF EXISTS {{.Schema}}."{{.OutboxName}}_notify"();
