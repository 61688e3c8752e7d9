package sqldb_test

import (
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/internal/sqldb"
	"github.com/oncemill/oncemill/internal/testing/sqltest"
)

// TestNewKeyPathsReplay: the new-key paths, written out with their
// parameters spliced in, do on each database what the inbox does: the
// started path counts the attempt in a row of its own, and its claim takes
// the key and clears the count in one transaction; the unstarted path
// takes the key with no count. Each leaves the key done.
func TestNewKeyPathsReplay(t *testing.T) {
	for _, b := range sqltest.Backends {
		t.Run(b.Name, func(t *testing.T) {
			t.Parallel()
			ctx := t.Context()
			db := b.Open(t, 2)
			sdb := db.SQL()
			d := sdb.Dialect()
			names := d.Names(db.Schema)
			key := "k1"
			lit := func(param string) string {
				switch param {
				case "consumer":
					return "'replay'"
				case "key":
					return "'" + key + "'"
				case "now":
					return strconv.FormatInt(time.Now().UnixMicro(), 10)
				}
				return "3600000000"
			}
			count := func(table, k string) int {
				var n int
				require.NoError(t, sdb.QueryRow(ctx, "SELECT COUNT(*) FROM "+table+" WHERE consumer = 'replay' AND "+d.Quote("key")+" = '"+k+"'").Scan(&n))
				return n
			}
			status := func(k string) string {
				var s string
				require.NoError(t, sdb.QueryRow(ctx, "SELECT status FROM "+names.Inbox+" WHERE consumer = 'replay' AND "+d.Quote("key")+" = '"+k+"'").Scan(&s))
				return s
			}
			claim := func(stmts []string) {
				tx, err := sdb.Begin(ctx, sqldb.TxOptions{})
				require.NoError(t, err)
				for _, s := range stmts {
					_, err := tx.Exec(ctx, s)
					require.NoError(t, err, s)
				}
				require.NoError(t, tx.Commit(ctx))
			}

			started, _ := d.NewKeyPaths(names, lit)
			require.NotEmpty(t, started.Start)
			for _, s := range started.Start {
				_, err := sdb.Exec(ctx, s)
				require.NoError(t, err, s)
			}
			require.Equal(t, 1, count(names.InboxStarts, key), "the start counts the attempt")
			require.Zero(t, count(names.Inbox, key), "the start takes no key")
			claim(started.Claim)
			require.Equal(t, "done", status(key))
			require.Zero(t, count(names.InboxStarts, key), "the claim clears the count")

			key = "k2"
			_, unstarted := d.NewKeyPaths(names, lit)
			require.Empty(t, unstarted.Start)
			claim(unstarted.Claim)
			require.Equal(t, "done", status(key))
			require.Zero(t, count(names.InboxStarts, key))
		})
	}
}
