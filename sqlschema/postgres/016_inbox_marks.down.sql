DROP TABLE IF EXISTS {{.InboxMarks}};
