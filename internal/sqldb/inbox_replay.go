package sqldb

import (
	"strconv"
	"strings"

	"github.com/oncemill/oncemill/sqlschema"
)

// NewKeyPath is what the transactional inbox sends for a delivery whose
// key is new, written out for a tool that replays it without a Go client
// (the benchmarks' server-side bound: pgbench, mariadb-slap): Start is
// the attempt record, committed on its own before the handler's
// transaction, and Claim the statements inside that transaction, before
// the handler's own.
type NewKeyPath struct {
	Start []string
	Claim []string
}

// NewKeyPaths renders the new-key path on the tables of names, started
// (the default: a start counts the attempt first) and unstarted (a
// delivery the broker counts, or one below a Kafka hand-out mark: no
// record), with each parameter spliced in as the SQL text lit returns
// for its name: "consumer", "key", "window" (microseconds) or, where the
// dialect takes the writer's clock (SQLite), "now" (microseconds since the
// Unix epoch).
func (d *Dialect) NewKeyPaths(names sqlschema.Names, lit func(param string) string) (started, unstarted NewKeyPath) {
	q := d.inboxStatements(names)
	s := func(stmts ...stmt) []string {
		out := make([]string, len(stmts))
		for i, st := range stmts {
			out[i] = d.spliced(st, lit)
		}
		return out
	}
	if d.writeCTE {
		started.Start = s(q.start)
		started.Claim = s(q.claimNew)
	} else {
		started.Start = s(q.startRead, q.startCount)
		started.Claim = s(q.claimNew, q.clearStart)
	}
	unstarted.Claim = s(q.claimNewUnstarted)
	return started, unstarted
}

// replayNames names the parameters a new key's path takes.
var replayNames = map[arg]string{argConsumer: "consumer", argKey: "key", argWindow: "window", argNow: "now"}

// spliced is s with each placeholder replaced by lit of its parameter's
// name.
func (d *Dialect) spliced(s stmt, lit func(param string) string) string {
	n := 0
	return rewrite(s.sql, func(b *strings.Builder, q string, i int) int {
		var (
			a     arg
			width int
		)
		switch {
		case d.placeholder == nil && q[i] == '?':
			a, width = s.args[n], 1
			n++
		case d.placeholder != nil && q[i] == '$':
			j := i + 1
			for j < len(q) && q[j] >= '0' && q[j] <= '9' {
				j++
			}
			k, err := strconv.Atoi(q[i+1 : j])
			if err != nil {
				return 0
			}
			a, width = s.args[k-1], j-i
		default:
			return 0
		}
		name, ok := replayNames[a]
		if !ok {
			panic("sqldb: a new key's path takes no parameter " + strconv.Itoa(int(a)))
		}
		b.WriteString(lit(name))
		return width
	})
}
