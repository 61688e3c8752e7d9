package main

import (
	"strings"
	"testing"

	"github.com/oncemill/oncemill/internal/sqldb"
	"github.com/oncemill/oncemill/internal/testing/mysqltest"
	"github.com/oncemill/oncemill/internal/testing/pgtest"
	"github.com/oncemill/oncemill/sqlschema"
)

// TestSmoke runs every script once on PostgreSQL (pgbench) and MariaDB
// (mariadb-slap), briefly: no client aborts, and each script commits
// messages.
func TestSmoke(t *testing.T) {
	// Fail under CI=true when a server is unreachable.
	pgtest.Pool(t, 1)
	mysqltest.DB(t, 1)
	ctx := t.Context()
	pg, err := postgres(ctx, pgtest.URL(), 2, 1, 1)
	if err != nil {
		t.Fatal(err)
	}
	my, err := mariadb(ctx, mysqltest.DSN(), 2, 200, 1)
	if err != nil {
		t.Fatal(err)
	}
	for db, rates := range map[string]map[string][]float64{"postgres": pg, "mysql": my} {
		for _, s := range scripts {
			if len(rates[s]) != 1 || rates[s][0] <= 0 {
				t.Errorf("%s %s: rates %v, want one above 0", db, s, rates[s])
			}
		}
	}
}

// TestScripts: each script is one message, the inbox's own statements for
// a new key in it: on PostgreSQL the start, BEGIN and the claim in one
// pipeline, as pgx sends them; on MariaDB a statement at a time.
func TestScripts(t *testing.T) {
	pg := messageScripts(sqldb.Postgres, sqldb.Postgres.Names(sqlschema.Config{Schema: schema}), "('b' || :k)", "", " ON CONFLICT DO NOTHING", true)
	def := strings.Join(pg["default"].lines, "\n")
	for _, want := range []string{`\startpipeline`, "_starts", "BEGIN;", `\endpipeline`, "INSERT INTO " + schema + ".effects", "COMMIT;"} {
		if !strings.Contains(def, want) {
			t.Errorf("postgres default script lacks %q:\n%s", want, def)
		}
	}
	if raw := strings.Join(pg["raw"].lines, "\n"); strings.Contains(raw, "pipeline") || strings.Contains(raw, "_starts") {
		t.Errorf("postgres raw script: %s", raw)
	}
	if un := strings.Join(pg["unstarted"].lines, "\n"); strings.Contains(un, "_starts") {
		t.Errorf("unstarted script touches the start count:\n%s", un)
	}
	my := messageScripts(sqldb.MySQL, sqldb.MySQL.Names(sqlschema.Config{Schema: schema}), "@k", "IGNORE ", "", false)
	if def := strings.Join(my["default"].lines, "\n"); strings.Contains(def, "pipeline") || !strings.Contains(def, "_starts") {
		t.Errorf("mysql default script:\n%s", def)
	}
}
