// Package sqlschema holds oncemill's SQL schema as versioned, embedded
// files and applies them.
//
// [Migrate] brings a PostgreSQL schema up to date under an advisory lock, so
// that every instance of a service may call it at start-up; [MigrateSQL]
// does the same through database/sql, for PostgreSQL and for MySQL 8 or
// MariaDB 10.6+ (under a named lock, each statement safe to run again,
// since MySQL does not run DDL in a transaction); [MigrateSQLite] does it
// for an SQLite file. Teams that run their own migration tool take the
// rendered SQL from [Migrations] instead.
//
// Schema and table names are configurable ([Config]) and validated as plain
// lower-case identifiers; no SQL is ever built from message data. One set of
// names per PostgreSQL schema (MySQL database, SQLite file): the version
// table records versions, not names.
package sqlschema
