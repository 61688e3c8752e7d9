package sqldb

import (
	"strings"

	"github.com/oncemill/oncemill/sqlschema"
)

// arg names a parameter of the inbox's statements.
type arg int

const (
	argConsumer  arg = iota // :c, the stored consumer
	argKey                  // :k, the stored key
	argWindow               // :w, the dedup window in microseconds
	argErr                  // :err, a failure's text
	argAt                   // :at, a failure's time in microseconds
	argGrant                // :grant
	argResult               // :res
	argLimit                // :lim
	argSince                // :since, microseconds
	argToken                // :tok
	argLease                // :lease, microseconds
	argNow                  // :now, the writer's clock in microseconds (clockParam)
	argGroup                // :g, a consumer group
	argTopic                // :t, a topic
	argPartition            // :p, a partition
	argOffset               // :o, an offset
	nArgs
)

var argNames = map[string]arg{"c": argConsumer, "k": argKey, "w": argWindow, "err": argErr, "at": argAt,
	"grant": argGrant, "res": argResult, "lim": argLimit, "since": argSince, "tok": argToken, "lease": argLease, "now": argNow,
	"g": argGroup, "t": argTopic, "p": argPartition, "o": argOffset}

// params are the values of a call's parameters, by name.
type params [nArgs]any

// stmt is a statement in its dialect's placeholders, with the parameter
// each placeholder takes, in order.
type stmt struct {
	sql  string
	args []arg
}

// bind returns the arguments of s from p.
func (s stmt) bind(p *params) []any {
	out := make([]any, len(s.args))
	for i, a := range s.args {
		out[i] = p[a]
	}
	return out
}

// named renders q, whose parameters are written :name (outside quotes
// and casts),
// in the dialect's placeholders: numbered and reused where the dialect
// numbers them, else one '?' per use.
func (d *Dialect) named(q string) stmt {
	var (
		s    stmt
		seen = map[arg]int{}
	)
	s.sql = rewrite(q, func(b *strings.Builder, q string, i int) int {
		switch {
		case q[i] != ':' || i+1 == len(q):
			return 0
		case q[i+1] == ':': // a cast
			b.WriteString("::")
			return 2
		case q[i+1] < 'a' || q[i+1] > 'z':
			return 0
		}
		j := i + 1
		for j < len(q) && q[j] >= 'a' && q[j] <= 'z' {
			j++
		}
		a, ok := argNames[q[i+1:j]]
		if !ok {
			panic("sqldb: unknown parameter :" + q[i+1:j])
		}
		n, ok := seen[a]
		if d.placeholder == nil || !ok {
			s.args = append(s.args, a)
			n = len(s.args)
			seen[a] = n
		}
		if d.placeholder == nil {
			b.WriteByte('?')
		} else {
			b.WriteString(d.placeholder(n))
		}
		return j - i
	})
	return s
}

// inboxSQL is the inbox's statements for one set of tables, rendered
// once. Where a dialect takes two statements or more for what PostgreSQL
// does in one (writeCTE), the one-statement form is empty and the
// protocol runs the parts.
type inboxSQL struct {
	start, startRead, startCount, unstart, clearStart stmt
	claim, claimNew, claimNewUnstarted, read, reclaim stmt
	reclaimHot, reclaimFailure                        stmt
	bury, buryHot, buryFailure, complete              stmt
	fail, failHot, failedStatus, failFailure          stmt
	grant, granted, deadCopy                          stmt
	reopen, reopenHot, reopenFailure                  stmt
	peek, hasRecord, doneKeys                         stmt
	sweep, expiredStarts, expired, delStart, delRec   stmt
	delFailure                                        stmt
	markRead, markWrite                               stmt
}

// inboxStatements renders the statements for the tables of names. Only
// validated identifiers are spliced in; every value is a parameter.
//
// A key's record is two rows. The inbox table's is narrow, the one a
// claim writes: status, the stored result, when it was done, when it
// expires, a lease's token and end. The failure table's holds what only a
// failure, a dead mark, a replay grant or a lease writes: attempts, first
// and last error, the dead mark's time and copies, the grant; it goes
// with its key's row. attempts is the count of the key's attempts that
// claimed it and ended, as one wide row held it: a done key without a
// failure row had one.
func (d *Dialect) inboxStatements(names sqlschema.Names) inboxSQL {
	key, now := d.Quote("key"), d.Now()
	if d.clockParam {
		now = ":now"
	}
	r := strings.NewReplacer("{T}", names.Inbox, "{S}", names.InboxStarts, "{F}", names.InboxFailures, "{M}", names.InboxMarks,
		"{key}", key, "{NOW}", now,
		"{EXP}", d.nowPlus(":w"), "{AT}", d.FromMicros(":at"), "{I}", d.rowAlias, "{o}", d.oldRow(),
		"{GREATEST}", d.greatest)
	n := func(q string) stmt { return d.named(r.Replace(q)) }
	us := d.Micros
	this := "consumer = :c AND {key} = :k"
	dead := "EXISTS (SELECT 1 FROM {T} WHERE " + this + " AND status = 'dead')"
	var q inboxSQL

	// The key's record, as a claim and a start answer it.
	joined := " FROM {T} i LEFT JOIN {F} f ON f.consumer = i.consumer AND f.{key} = i.{key}\n" +
		"WHERE i.consumer = :c AND i.{key} = :k"
	attempts := "COALESCE(f.attempts, CASE WHEN i.status = 'done' THEN 1 ELSE 0 END)"
	record := "i.status, " + attempts + ", i.result, " + us("f.first_failed_at")
	q.read = n("SELECT " + record + joined + d.readLatest())
	q.startRead = n("SELECT " + record + joined + " AND i.status IN ('done', 'dead')")

	// A start counts the attempt; a count is the statement's insert id
	// where there is no RETURNING.
	q.startCount = n("INSERT INTO {S}{I} (consumer, {key}, started, expires_at) VALUES (:c, :k, " + d.counted("1") + ", {EXP})" +
		d.upsert("consumer, {key}", [][2]string{{"started", d.counted("{o}started + 1")}, {"expires_at", d.excluded("expires_at")}}, "") +
		d.returning("started"))
	if d.writeCTE {
		// Counts the attempt unless the key is done or dead, which it
		// reads in the same statement: a duplicate is answered here,
		// without a transaction. It commits on its own, before the
		// handler's transaction begins.
		q.start = n(`WITH rec AS (
	SELECT i.status, ` + attempts + ` AS attempts, i.result, f.first_failed_at` + joined + ` AND i.status IN ('done', 'dead')
), st AS (
	INSERT INTO {S}{I} (consumer, {key}, started, expires_at)
	SELECT :c, :k, 1, {EXP} WHERE NOT EXISTS (SELECT 1 FROM rec)` +
			d.upsert("consumer, {key}", [][2]string{{"started", "{o}started + 1"}, {"expires_at", d.excluded("expires_at")}}, "") + `
	RETURNING started
)
SELECT status, attempts, result, ` + us("first_failed_at") + ` FROM rec
UNION ALL
SELECT 'new', started, NULL, NULL FROM st`)
	}
	q.unstart = n("UPDATE {S} SET started = started - 1 WHERE " + this + " AND started > 0")
	q.clearStart = n("DELETE FROM {S} WHERE " + this)

	// The claim writes the key's narrow row as done at once: it becomes
	// visible when the transaction commits, together with the effect, and
	// a concurrent claimer waits on the uncommitted row until then. An
	// existing row is left alone, and a done key's duplicates never queue
	// behind each other (PostgreSQL's DO NOTHING takes no lock); the
	// caller reads it in a statement of its own (readLatest), and takes a
	// failed key with reclaim. Where there is no RETURNING, the insert id
	// says whether the row was inserted (1) or not (0).
	insertRow := "INSERT INTO {T} (consumer, {key}, status, done_at, expires_at)\n" +
		"VALUES (:c, :k, 'done', " + d.reported("1", "{NOW}") + ", {EXP})"
	insert := insertRow + d.InsertOnce("(consumer, {key})", "") + "\nRETURNING 'new', 1, NULL, NULL"
	if !d.Returning {
		insert = insertRow + d.upsert("consumer, {key}", [][2]string{{"done_at", d.reported("0", "done_at")}}, "")
	}
	q.claim, q.claimNew, q.claimNewUnstarted = n(insert), n(insert), n(insert)
	reclaimHot := "UPDATE {T} SET status = 'done', lease_until = NULL, done_at = {NOW}, expires_at = {EXP}\n" +
		"WHERE " + this + " AND status = 'failed'"
	// The taken key's attempt counts in its failure row, in the claim's
	// transaction: a rollback takes it back.
	reclaimFailure := "INSERT INTO {F}{I} (consumer, {key}, attempts, created_at, updated_at) "
	countFailure := d.upsert("consumer, {key}", [][2]string{{"attempts", "{o}attempts + 1"}, {"updated_at", d.excluded("updated_at")}}, "")
	q.reclaimHot = n(reclaimHot)
	q.reclaimFailure = n(reclaimFailure + "VALUES (:c, :k, 1, {NOW}, {NOW})" + countFailure + d.returning("attempts, "+us("first_failed_at")))
	if d.writeCTE {
		// The key's start count goes in the same statement: the delete
		// commits with the effect, and a rollback (or a crash) keeps it.
		del := "WITH del AS (DELETE FROM {S} WHERE " + this + ")\n"
		q.claimNew = n(del + insert)
		q.reclaim = n(del + ", up AS (" + reclaimHot + " RETURNING 1)\n" +
			reclaimFailure + "SELECT :c, :k, 1, {NOW}, {NOW} FROM up" + countFailure + "\nRETURNING attempts, " + us("first_failed_at"))
		// The claim that also answers a key that has a record, in the
		// same round trip; it runs on the statement's snapshot, so a row
		// committed while the INSERT waited is read again by the caller.
		q.claim = n(`WITH del AS (
	DELETE FROM {S} WHERE ` + this + `
), ins AS (
	` + insertRow + d.InsertOnce("(consumer, {key})", "") + `
	RETURNING 1
)
SELECT 'new', 1, NULL, NULL FROM ins
UNION ALL
SELECT ` + record + joined + ` AND NOT EXISTS (SELECT 1 FROM ins)`)
	}

	// Burying records the failure and the dead mark, and clears the
	// replay grant: a grant reopens a key once. The claim that took the
	// key for burying counted itself as an attempt (a reclaim); the bury
	// takes that back.
	buryHot := "UPDATE {T} SET status = 'dead', result = NULL, done_at = NULL WHERE " + this
	buryFailure := "INSERT INTO {F}{I} (consumer, {key}, attempts, first_error, last_error, first_failed_at, last_failed_at, dead_at, created_at, updated_at)\n"
	buryValues := ":c, :k, 0, :err, :err, {AT}, {AT}, {NOW}, {NOW}, {NOW}"
	buryUpsert := d.upsert("consumer, {key}", [][2]string{
		{"attempts", "{GREATEST}({o}attempts - 1, 0)"},
		{"first_error", "COALESCE({o}first_error, " + d.excluded("first_error") + ")"},
		{"first_failed_at", "COALESCE({o}first_failed_at, " + d.excluded("first_failed_at") + ")"},
		{"last_error", d.excluded("last_error")},
		{"last_failed_at", d.excluded("last_failed_at")},
		{"dead_at", d.excluded("dead_at")},
		{"replay_grant", "NULL"},
		{"updated_at", d.excluded("updated_at")},
	}, "")
	q.buryHot = n(buryHot)
	q.buryFailure = n(buryFailure + "VALUES (" + buryValues + ")" + buryUpsert)
	if d.writeCTE {
		q.bury = n("WITH up AS (" + buryHot + " RETURNING 1)\n" + buryFailure + "SELECT " + buryValues + " FROM up" + buryUpsert)
	}
	q.complete = n("UPDATE {T} SET result = :res WHERE " + this)

	// A failure writes the key's row as failed, unless it is done or dead,
	// and counts the attempt in its failure row.
	failHot := "INSERT INTO {T}{I} (consumer, {key}, status, expires_at) VALUES (:c, :k, 'failed', {EXP})" +
		d.upsert("consumer, {key}", [][2]string{
			{"lease_until", "NULL"},
			{"expires_at", d.excluded("expires_at")},
			{"status", "'failed'"}, // last: MySQL's assignments see the ones before
		}, "{o}status NOT IN ('done', 'dead')")
	failFailure := "INSERT INTO {F}{I} (consumer, {key}, attempts, first_error, last_error, first_failed_at, last_failed_at, created_at, updated_at)\n"
	failValues := ":c, :k, 1, :err, :err, {AT}, {AT}, {NOW}, {NOW}"
	failUpsert := d.upsert("consumer, {key}", [][2]string{
		{"attempts", "{o}attempts + 1"},
		{"first_error", "COALESCE({o}first_error, " + d.excluded("first_error") + ")"},
		{"first_failed_at", "COALESCE({o}first_failed_at, " + d.excluded("first_failed_at") + ")"},
		{"last_error", d.excluded("last_error")},
		{"last_failed_at", d.excluded("last_failed_at")},
		{"updated_at", d.excluded("updated_at")},
	}, "")
	q.failHot = n(failHot)
	q.failedStatus = n("SELECT status FROM {T} WHERE " + this)
	q.failFailure = n(failFailure + "VALUES (" + failValues + ")" + failUpsert)
	if d.writeCTE {
		q.fail = n("WITH up AS (" + failHot + " RETURNING 1)\n" + failFailure + "SELECT " + failValues + " FROM up" + failUpsert)
	}

	q.grant = n("UPDATE {F} SET replay_grant = :grant, updated_at = {NOW} WHERE " + this + " AND " + dead)
	q.granted = n("SELECT COUNT(*) FROM {F} WHERE " + this + " AND replay_grant = :grant")
	// Only for the grant written on the dead key; the attempts that
	// started are forgotten only when it reopens.
	reopenHot := "UPDATE {T} SET status = 'failed', lease_until = NULL WHERE " + this + " AND status = 'dead'\n" +
		"AND EXISTS (SELECT 1 FROM {F} WHERE " + this + " AND replay_grant = :grant)"
	reopenFailure := "UPDATE {F} SET attempts = 0, dead_at = NULL, updated_at = {NOW} WHERE " + this
	q.reopenHot, q.reopenFailure = n(reopenHot), n(reopenFailure)
	if d.writeCTE {
		q.reopen = n("WITH up AS (" + reopenHot + " RETURNING 1),\n" +
			"f AS (" + reopenFailure + " AND EXISTS (SELECT 1 FROM up)),\n" +
			"del AS (DELETE FROM {S} WHERE " + this + " AND EXISTS (SELECT 1 FROM up))\nSELECT COUNT(*) FROM up")
	}
	q.deadCopy = n("UPDATE {F} SET dead_copies = dead_copies + 1 WHERE " + this + " AND " + dead)

	// The committed, unexpired record only; a claim in progress is
	// invisible.
	q.peek = n("SELECT " + record + ", CASE WHEN i.status = 'processing' AND i.lease_until > {NOW} THEN " + us("i.lease_until") + " END\n" +
		joined + " AND i.expires_at > {NOW}")
	// Any row, expired or not: a claim reads the row until cleanup
	// deletes it.
	q.hasRecord = n("SELECT COUNT(*) FROM {T} WHERE " + this)
	q.doneKeys = n("SELECT {key} FROM {T} WHERE consumer = :c AND status = 'done' AND done_at >= " + d.FromMicros(":since") + " AND expires_at > {NOW}")

	// Sweeping never waits for a row another transaction holds (SKIP
	// LOCKED; SQLite's one writer holds no rows), and a key's failure row
	// goes with it. In one statement where a DELETE can select its rows
	// so; elsewhere the expired rows are locked and then deleted one by
	// one by their primary key, which looks at no other row (a DELETE
	// naming many rows may be planned as a scan, and a scan waits on the
	// rows SKIP LOCKED left out).
	if d.writeCTE {
		q.sweep = n(`WITH starts AS (
	DELETE FROM {S} WHERE (consumer, {key}) IN (
		SELECT consumer, {key} FROM {S} WHERE expires_at < {NOW} LIMIT :lim FOR UPDATE SKIP LOCKED)
)
DELETE FROM {T} WHERE (consumer, {key}) IN (
	SELECT consumer, {key} FROM {T} WHERE expires_at < {NOW} LIMIT :lim FOR UPDATE SKIP LOCKED)`)
	}
	q.expiredStarts = n("SELECT consumer, {key} FROM {S} WHERE expires_at < {NOW} ORDER BY expires_at LIMIT :lim" + d.LockRow(true))
	q.expired = n("SELECT consumer, {key} FROM {T} WHERE expires_at < {NOW} ORDER BY expires_at LIMIT :lim" + d.LockRow(true))
	q.delStart = q.clearStart
	q.delFailure = n("DELETE FROM {F} WHERE " + this)
	q.delRec = n("DELETE FROM {T} WHERE " + this)

	// The hand-out marks (delivery.HandOutMarks): a mark only rises.
	partition := "consumer_group = :g AND topic = :t AND kafka_partition = :p"
	q.markRead = n("SELECT handed_out FROM {M} WHERE " + partition)
	q.markWrite = n("INSERT INTO {M}{I} (consumer_group, topic, kafka_partition, handed_out, updated_at) VALUES (:g, :t, :p, :o, {NOW})" +
		d.upsert("consumer_group, topic, kafka_partition", [][2]string{
			{"handed_out", "{GREATEST}({o}handed_out, " + d.excluded("handed_out") + ")"},
			{"updated_at", d.excluded("updated_at")},
		}, ""))
	return q
}

// oldRow is the prefix of a column of the existing row in an upsert's
// assignments: the alias rowAlias gives it, or none.
func (d *Dialect) oldRow() string {
	if d.rowAlias == "" {
		return ""
	}
	return strings.TrimPrefix(d.rowAlias, " AS ") + "."
}

// returning is the RETURNING clause of cols, "" where there is none.
func (d *Dialect) returning(cols string) string {
	if !d.Returning {
		return ""
	}
	return "\nRETURNING " + cols
}

// readLatest ends a read of the key's record in the claim's transaction
// so that it sees the latest commit: a locking read where a plain one
// sees the transaction's snapshot.
func (d *Dialect) readLatest() string {
	if d.snapshotReads {
		return d.LockRow(false)
	}
	return ""
}
