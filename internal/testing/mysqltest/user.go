package mysqltest

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"testing"

	"github.com/go-sql-driver/mysql"
)

// User is a database user of one test that may use one database: read and
// write every table in it, as an application's user, and no more. The
// test server's user is root, whose statements pass every permission
// check; a store that connects as the user ([User.Config]) is checked, so
// a test can take a privilege away ([User.ReadOnly]) and see what the
// store does.
//
// Its privileges are granted table by table: a change to a table's
// privileges holds for the next statement of every session, where one to
// a database's holds only from the session's next USE.
type User struct {
	// Name is the user's name, unique to the test; its host is '%'.
	Name     string
	admin    *sql.DB
	database string
}

// NewUser creates a user for the test, without a password, with SELECT,
// INSERT, UPDATE and DELETE on each table in database when called, and
// drops it when the test ends. admin is root's pool, such as [DB]'s.
func NewUser(t testing.TB, admin *sql.DB, database string) User {
	t.Helper()
	var b [6]byte
	if _, err := rand.Read(b[:]); err != nil {
		t.Fatalf("random user name: %v", err)
	}
	// MySQL allows 32 characters in a user name.
	u := User{Name: "oncemill_" + hex.EncodeToString(b[:]), admin: admin, database: database}
	u.exec(t, "CREATE USER '"+u.Name+"'@'%'")
	t.Cleanup(func() {
		if _, err := admin.ExecContext(context.Background(), "DROP USER IF EXISTS '"+u.Name+"'@'%'"); err != nil {
			t.Errorf("drop test user %s: %v", u.Name, err)
		}
	})
	rows, err := admin.QueryContext(t.Context(),
		`SELECT table_name FROM information_schema.tables WHERE table_schema = ?`, database)
	if err != nil {
		t.Fatalf("test user %s: list the tables of %s: %v", u.Name, database, err)
	}
	var tables []string
	for rows.Next() {
		var table string
		if err := rows.Scan(&table); err != nil {
			t.Fatalf("test user %s: list the tables of %s: %v", u.Name, database, err)
		}
		tables = append(tables, table)
	}
	if err := rows.Err(); err != nil {
		t.Fatalf("test user %s: list the tables of %s: %v", u.Name, database, err)
	}
	for _, table := range tables {
		u.exec(t, "GRANT SELECT, INSERT, UPDATE, DELETE ON "+u.table(table)+" TO '"+u.Name+"'@'%'")
	}
	return u
}

// Config returns the test server's driver configuration (see [Config])
// for the user, on its database.
func (u User) Config(t testing.TB) *mysql.Config {
	t.Helper()
	cfg := Config(t, u.database)
	cfg.User, cfg.Passwd = u.Name, ""
	return cfg
}

// ReadOnly takes INSERT, UPDATE and DELETE on tables of the user's
// database away from the user, which may still read them: a database user
// granted SELECT only.
func (u User) ReadOnly(t testing.TB, tables ...string) {
	t.Helper()
	for _, table := range tables {
		u.exec(t, "REVOKE INSERT, UPDATE, DELETE ON "+u.table(table)+" FROM '"+u.Name+"'@'%'")
	}
}

// Writable grants INSERT, UPDATE and DELETE on tables of the user's
// database to the user again, repairing [User.ReadOnly].
func (u User) Writable(t testing.TB, tables ...string) {
	t.Helper()
	for _, table := range tables {
		u.exec(t, "GRANT INSERT, UPDATE, DELETE ON "+u.table(table)+" TO '"+u.Name+"'@'%'")
	}
}

func (u User) table(name string) string { return "`" + u.database + "`.`" + name + "`" }

func (u User) exec(t testing.TB, q string) {
	t.Helper()
	if _, err := u.admin.ExecContext(context.Background(), q); err != nil {
		t.Fatalf("test user %s: %s: %v", u.Name, q, err)
	}
}
