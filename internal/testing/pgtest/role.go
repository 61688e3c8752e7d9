package pgtest

import (
	"context"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Role is a database role of one test that may use one schema: read and
// write every table in it, as an application's user, and no more. The test
// server's user is a superuser, whose statements skip every permission
// check; a store that connects as it with the role as its run-time `role`
// parameter ([Role.Param]) runs each statement as the role, checks
// included, so a test can take a privilege away ([Role.ReadOnly]) and see
// what the store does.
type Role struct {
	// Name is the role's name, unique to the test.
	Name   string
	admin  *pgxpool.Pool
	schema string
}

// NewRole creates a role for the test (NOLOGIN: only a superuser's session
// can become it) with USAGE on schema and SELECT, INSERT, UPDATE and
// DELETE on the tables in it and USAGE on its sequences (a lease claim
// draws its token from one) when called, and drops it when the test ends.
// admin is a superuser's pool, such as [Pool]'s.
func NewRole(t testing.TB, admin *pgxpool.Pool, schema string) Role {
	t.Helper()
	r := Role{Name: Name(t), admin: admin, schema: schema}
	name, sch := pgx.Identifier{r.Name}.Sanitize(), pgx.Identifier{schema}.Sanitize()
	r.exec(t, `CREATE ROLE `+name+` NOLOGIN`)
	t.Cleanup(func() {
		// DROP OWNED revokes what the role was granted, which DROP ROLE
		// would otherwise refuse to leave behind.
		if _, err := admin.Exec(context.Background(), `DROP OWNED BY `+name+`; DROP ROLE `+name); err != nil {
			t.Errorf("drop test role %s: %v", r.Name, err)
		}
	})
	r.exec(t, `GRANT USAGE ON SCHEMA `+sch+` TO `+name)
	r.exec(t, `GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA `+sch+` TO `+name)
	r.exec(t, `GRANT USAGE ON ALL SEQUENCES IN SCHEMA `+sch+` TO `+name)
	return r
}

// Param is the run-time parameter that makes a session run as the role:
// its key and value, for pgx.ConnConfig.RuntimeParams or a connection
// URL's query (pgx and lib/pq send either in the startup message).
func (r Role) Param() (key, value string) { return "role", r.Name }

// ReadOnly takes INSERT, UPDATE and DELETE on tables of the role's schema
// away from the role, which may still read them: a database user granted
// SELECT only. It holds for the next statement of every session.
func (r Role) ReadOnly(t testing.TB, tables ...string) {
	t.Helper()
	r.exec(t, `REVOKE INSERT, UPDATE, DELETE ON `+r.tables(tables)+` FROM `+pgx.Identifier{r.Name}.Sanitize())
}

// Writable grants INSERT, UPDATE and DELETE on tables of the role's schema
// to the role again, repairing [Role.ReadOnly].
func (r Role) Writable(t testing.TB, tables ...string) {
	t.Helper()
	r.exec(t, `GRANT INSERT, UPDATE, DELETE ON `+r.tables(tables)+` TO `+pgx.Identifier{r.Name}.Sanitize())
}

// tables is the list of tables, qualified by the role's schema.
func (r Role) tables(tables []string) string {
	q := make([]string, len(tables))
	for i, table := range tables {
		q[i] = pgx.Identifier{r.schema, table}.Sanitize()
	}
	return strings.Join(q, ", ")
}

func (r Role) exec(t testing.TB, sql string) {
	t.Helper()
	if _, err := r.admin.Exec(context.Background(), sql); err != nil {
		t.Fatalf("test role %s: %s: %v", r.Name, sql, err)
	}
}
