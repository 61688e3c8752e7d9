package deduptest

import (
	"context"
	"testing"
	"time"

	"github.com/oncemill/oncemill/dedup"
)

// TxHarness describes a [dedup.TxStore] implementation to [RunTxStore].
// Fields added later keep their zero value's meaning: what the suite
// did before.
type TxHarness struct {
	// New returns a store under test for one subtest, with what the suite
	// needs to drive it. Required.
	//
	// Each call must return a store isolated from every other one it
	// returned (its own schema, database file or key prefix), because
	// subtests assert on exact counts and run in parallel: New is called
	// from several goroutines at once. Register the store's teardown with
	// t.Cleanup; the suite does not close the store.
	New func(t *testing.T) TxBundle
}

// TxBundle is one store under test of a [TxHarness], with the hooks the
// suite uses to write and count the business effect in the store's
// transaction.
type TxBundle struct {
	// Store is the store under test. Required. Its optional interfaces
	// ([dedup.Expirer], [dedupdriver.Peeker], [dedupdriver.RecordFinder],
	// [dedupdriver.KeyLister], [dedupdriver.StartClaimer],
	// [dedupdriver.BeginClaimer], [dedupdriver.BatchClaimer], and
	// [dedupdriver.Classifier] on its [dedup.InboxTx]) are found by type
	// assertion and tested when present.
	Store dedup.TxStore
	// Effect writes one business effect for key inside tx, the way a
	// handler does: through the transaction that tx.WithTx(ctx) carries
	// and the store package's accessor (postgres.Tx, sqlite.Tx), into a
	// table of the harness's choosing. The suite calls it only on a
	// transaction whose claim answered [dedup.StateNew]. key is the
	// message key ([dedup.Key.Key]); the suite counts effects only of
	// keys that no other consumer of the subtest uses. Required.
	Effect func(ctx context.Context, tx dedup.InboxTx, key string) error
	// Effects counts the committed effects of key, outside any of the
	// store's transactions. Required.
	Effects func(ctx context.Context, key string) (int, error)
	// DeadCopies reads how many copies of a dead key
	// [dedup.Graveyard.InboxDeadCopy] counted on its record, for the suite
	// to check the count. Optional: without it the suite checks only that
	// counting a copy fails nothing and changes no state, and skips the
	// DeadCopies subtest.
	DeadCopies func(ctx context.Context, key dedup.Key) (int, error)
	// Cut breaks every connection of Store to its server and makes new ones
	// fail, for the rest of the subtest, as a server that went away or a
	// network partition would: the suite then checks that every call fails for
	// the infrastructure's fault (an error wrapping [dedup.ErrUnavailable]) and
	// that the transaction's [dedupdriver.Classifier] says so of the handler's
	// errors. It must not break what Effects reads through, nor the harness's
	// own cleanup. [Proxy] does this for a store that reaches its server over
	// TCP. Optional: an embedded store (SQLite) has no connection to lose, and
	// without Cut the Cut subtest is skipped.
	Cut func(t *testing.T)
	// Misconfigure breaks the store's use of its own tables, in each way
	// the harness can, by name: "MissingTable" (the tables dropped, as if
	// never migrated) or "ReadOnly" (the store's database user may read
	// them but not write them), say. Each returns the repair (migrating
	// again, granting again). A superuser's statements skip permission
	// checks, so for "ReadOnly" the harness's store connects as a user of
	// its own, granted what an application's user is, and the break
	// revokes its writes on the store's tables. The Misconfigured subtest checks that the
	// store's calls then fail for the infrastructure's fault (an error
	// wrapping [dedup.ErrUnavailable]): the inbox and the poison
	// middleware nack the message, never count it and never dead-letter
	// it, and once repaired it is applied once. It must not break what
	// Effects reads through. Optional: without it the subtest is skipped.
	Misconfigure map[string]func(t *testing.T) (repair func(t *testing.T))
	// Refused runs in tx a statement the database refuses (a division by
	// zero, say), the way Effect writes: through the transaction that
	// tx.WithTx(ctx) carries. It returns the database's error. The Aborted
	// subtest calls it on a transaction whose [dedupdriver.AbortReporter]
	// must then report it aborted. Optional: without it, or on a
	// transaction that is no AbortReporter, the subtest is skipped.
	Refused func(ctx context.Context, tx dedup.InboxTx) error
}

// LeaseHarness describes a [dedup.LeaseStore] implementation to
// [RunLeaseStore]. Fields added later keep their zero value's meaning:
// what the suite did before.
type LeaseHarness struct {
	// New returns a store under test for one subtest. Required. The rules
	// of [TxHarness.New] apply: isolated stores, called concurrently,
	// teardown with t.Cleanup.
	New func(t *testing.T) LeaseBundle
}

// LeaseBundle is one store under test of a [LeaseHarness]. The effect of
// lease mode lives outside the store, so the suite counts it itself.
type LeaseBundle struct {
	// Store is the store under test. Required. Its optional interfaces
	// ([dedup.Expirer], [dedupdriver.Peeker], [dedupdriver.RecordFinder],
	// [dedupdriver.KeyLister]) are found by type assertion and tested when
	// present.
	Store dedup.LeaseStore
	// DeadCopies reads the count of dead copies on a key's record; see
	// [TxBundle.DeadCopies]. Optional.
	DeadCopies func(ctx context.Context, key dedup.Key) (int, error)
	// Cut breaks every connection of Store; see [TxBundle.Cut]. Optional.
	Cut func(t *testing.T)
}

// The durations the suite claims with. Short ones pass during a subtest;
// long ones never do.
const (
	// shortLease is a lease that the suite waits out.
	shortLease = 50 * time.Millisecond
	// shortWindow is a dedup window that the suite waits out: the
	// records claimed with it are swept or expire by themselves.
	shortWindow = 50 * time.Millisecond
	// lease is a lease that holds for the whole subtest.
	lease = time.Hour
	// window is a dedup window that holds for the whole subtest.
	window = 2 * time.Hour
	// patience bounds every wait for a lease or a window to pass; a store
	// that takes longer fails the subtest. It is a bound on a failure,
	// not a measure of speed.
	patience = 30 * time.Second
	// copies is how many deliveries of one key the concurrent subtests
	// claim at once.
	copies = 50
	// consumer scopes the suite's keys; other names are used where two
	// consumers must be told apart.
	consumer = "deduptest"
)

// key returns the key k of the suite's consumer.
func key(k string) dedup.Key { return dedup.Key{Consumer: consumer, Key: k} }

// failedAt returns a failure time that every store keeps exactly: stores
// keep milliseconds (Redis) or microseconds (SQL), so it has none below
// the millisecond.
func failedAt(ago time.Duration) time.Time {
	return time.Now().Add(-ago).Truncate(time.Millisecond)
}

// eventually calls cond every few milliseconds until it reports true, and
// fails the test when patience passes first. cond runs on the test's
// goroutine, so it may use require.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(patience)
	for step := 5 * time.Millisecond; ; step = min(2*step, 50*time.Millisecond) {
		if cond() {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("gave up after %s waiting for %s", patience, what)
		}
		select {
		case <-t.Context().Done():
			t.Fatalf("test ended waiting for %s", what)
		case <-time.After(step):
		}
	}
}
