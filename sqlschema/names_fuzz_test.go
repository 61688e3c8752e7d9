package sqlschema_test

import (
	"regexp"
	"strings"
	"testing"

	"github.com/oncemill/oncemill/sqlschema"
)

var fuzzIdentifier = regexp.MustCompile(`^[a-z_][a-z0-9_]{0,47}$`)

// FuzzNames: any names given to sqlschema.Config are either accepted,
// each then a safe identifier (empty ones defaulted) and every table and
// the relations named after it distinct, with migrations that render on
// every database; or refused with an error that names a field, by
// Validate and Migrations alike.
func FuzzNames(f *testing.F) {
	f.Add("", "", "", "", "", "")
	f.Add("oncemill", "inbox", "outbox", "dlq", "outbox_ledger", "retries")
	f.Add("", strings.Repeat("a", 64), "", "", "", "")
	f.Add("", "", "", "inbox_starts", "", "")
	f.Add("", "outbox_scheduled", "", "", "", "")
	f.Add("x;y", "Inbox", "out\"box", "dlq`", "1ledger", "re tries")
	f.Add("", "", "", "outbox_due_idx", "", "")
	f.Fuzz(func(t *testing.T, schema, inbox, outbox, dlqTable, ledger, retry string) {
		cfg := sqlschema.Config{Schema: schema, InboxTable: inbox, OutboxTable: outbox, DLQTable: dlqTable, LedgerTable: ledger, RetryTable: retry}
		err := cfg.Validate()
		for _, d := range []sqlschema.Dialect{sqlschema.Postgres, sqlschema.MySQL, sqlschema.SQLite} {
			_, merr := sqlschema.Migrations(d, cfg)
			if (err == nil) != (merr == nil) {
				t.Fatalf("%+v: Validate says %v, Migrations(%s) %v", cfg, err, d, merr)
			}
		}
		if err != nil {
			named := false
			for _, field := range []string{"Schema", "InboxTable", "OutboxTable", "DLQTable", "LedgerTable", "RetryTable"} {
				named = named || strings.Contains(err.Error(), field)
			}
			if !named {
				t.Fatalf("%+v: error %q names no field", cfg, err)
			}
			return
		}
		c := cfg.WithDefaults()
		names := map[string]bool{}
		for _, n := range []string{c.InboxTable, c.OutboxTable, c.DLQTable, c.LedgerTable, c.RetryTable,
			c.InboxTable + "_starts", c.OutboxTable + "_scheduled"} {
			if names[n] {
				t.Fatalf("%+v accepted with two tables named %q", cfg, n)
			}
			names[n] = true
		}
		for _, n := range []string{c.Schema, c.InboxTable, c.OutboxTable, c.DLQTable, c.LedgerTable, c.RetryTable} {
			if !fuzzIdentifier.MatchString(n) {
				t.Fatalf("%+v accepted with the name %q", cfg, n)
			}
		}
	})
}
