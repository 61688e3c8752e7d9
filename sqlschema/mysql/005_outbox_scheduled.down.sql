DROP TABLE IF EXISTS {{.Scheduled}};
