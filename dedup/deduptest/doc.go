// Package deduptest is the conformance suite of the [dedup] store
// contract: one function per mode, [RunTxStore] for a [dedup.TxStore] and
// [RunLeaseStore] for a [dedup.LeaseStore], that a store's own tests call
// to prove it keeps the semantics the inbox and the poison middleware rely
// on. Every store of this module runs it (dedup/postgres in both modes,
// dedup/sqlite, dedup/sqlstore, dedup/twotier, dedup/redis, dedup/memory);
// a store written elsewhere runs it the same way. Its author reads the
// contract in [dedup] and the optional capabilities in [dedupdriver], then
// runs this suite.
//
// # Running the suite
//
// A harness says how to make a fresh store for one subtest and, in
// transactional mode, how to write and count the business effect inside
// the store's transaction. In the store's package:
//
//	func TestConformance(t *testing.T) {
//		deduptest.RunTxStore(t, deduptest.TxHarness{
//			New: func(t *testing.T) deduptest.TxBundle {
//				db := openTestDatabase(t) // its own schema or file, dropped by t.Cleanup
//				store, err := mystore.New(db)
//				require.NoError(t, err)
//				return deduptest.TxBundle{
//					Store: store,
//					Effect: func(ctx context.Context, tx dedup.InboxTx, key string) error {
//						_, err := mystore.Tx(tx.WithTx(ctx)).ExecContext(ctx, `INSERT INTO effects (key) VALUES (?)`, key)
//						return err
//					},
//					Effects: func(ctx context.Context, key string) (n int, err error) {
//						err = db.QueryRowContext(ctx, `SELECT count(*) FROM effects WHERE key = ?`, key).Scan(&n)
//						return n, err
//					},
//				}
//			},
//		})
//	}
//
// Run one behaviour with go test -run 'TestConformance/Rollback'. The
// subtests run in parallel, each on its own store, so New must be safe to
// call concurrently and the stores it makes must not see each other. The
// suite waits for short leases and windows (tens of milliseconds) to pass,
// polling; a store whose clock is the server's must run on a server whose
// clock agrees with the test's to within the suite's patience (30 s).
//
// # Capabilities
//
// A store implements the optional interfaces it can: [dedup.Expirer],
// [dedupdriver.Peeker], [dedupdriver.RecordFinder], [dedupdriver.KeyLister],
// [dedupdriver.StartClaimer], [dedupdriver.BeginClaimer],
// [dedupdriver.BatchClaimer], and [dedupdriver.Classifier] on its transaction.
// The suite finds them by type assertion; the subtest of an interface the store
// does not implement is skipped with a message naming it, which is legitimate:
// the store does not claim it. What every store of a mode must do is never
// skipped. Where an optional interface makes a required check stronger (a
// [dedupdriver.RecordFinder] proves that a call wrote no record), the required
// subtest uses it when it is there.
//
// # Cutting the connection
//
// A store that reaches its server over a network gives its bundle a Cut
// that breaks its connections, usually with a [Proxy] between the store
// and the server. The Cut subtest then checks the failure classes of the
// design: every call fails with an error wrapping [dedup.ErrUnavailable],
// a lease held meanwhile is not reported lost, and the transaction's
// [dedupdriver.Classifier] marks the handler's errors as the infrastructure's
// once the connection is gone (the Classify subtest checks that, with a
// healthy connection, a handler's own error stays the message's, whatever
// it wraps). Without Cut the subtest is skipped.
//
// # What the transactional suite checks
//
//   - ClaimCommitDuplicate: claim, effect, complete and commit make the key
//     done; later claims and starts answer it done with the stored result,
//     and no second effect is written.
//   - Result: a stored result comes back byte for byte (binary, 200 KiB),
//     to claims and starts; none stored answers nil.
//   - Consumers: two consumers of a key keep separate records.
//   - Rollback: a rolled-back claim undoes the effect and leaves the key
//     claimable as if it had never been claimed (only the start count of
//     StartCounts keeps the attempt).
//   - FailedReclaim: after a failure ([dedup.TxStore.InboxFail]) the key is
//     claimed again with its attempts counted and its first failure's time
//     kept; a failure reported after the commit changes nothing.
//   - ConcurrentDuplicates: 50 copies of one key (new, or failed before)
//     claimed at once apply it once; the others answer done or in flight.
//     RolledBack: the first winner fails and rolls back, and another copy
//     (redelivered while the key is in flight) claims the key and applies
//     it, once.
//   - Bury: a key buried in its claim's transaction is dead to claims and
//     starts; a late failure leaves it dead; a copy of it is counted
//     without error; a burial rolled back leaves the key claimable.
//   - DeadCopies: the count of dead copies, with [TxBundle.DeadCopies].
//   - ReplayGrant: grants are refused when empty and on keys that are not
//     dead; only the last grant written reopens a dead key, once, with its
//     attempts reset; dead-lettering it again clears the grant.
//   - StartCounts: [dedup.TxStore.InboxStart] counts attempts across
//     processes (a start without an end, a rollback and a failure stay
//     counted), [dedup.TxStore.InboxUnstart] takes one back, and a commit
//     forgets the count.
//   - Window: a record and a start count are forgotten once their window
//     has passed; a live record stays.
//   - Sweep ([dedup.Expirer]): expired records of every state are deleted
//     in batches of at most the limit; live ones stay.
//   - CanceledContext: a call on a context the caller canceled, or whose
//     deadline passed, never reports the store unavailable.
//   - Peek ([dedupdriver.Peeker]), HasRecord ([dedupdriver.RecordFinder]), DoneKeys
//     ([dedupdriver.KeyLister]): each state of a key as they answer it.
//   - Classify ([dedupdriver.Classifier]) and Cut: the failure classes above,
//     the pipelined and batched claims' calls included.
//   - Aborted ([dedupdriver.AbortReporter], with [TxBundle.Refused]): a
//     claimed transaction is not aborted, not after an effect either, and
//     is once a statement in it failed; its rollback leaves no effect and
//     the key claimable, in a transaction that is not aborted.
//   - StartClaim ([dedupdriver.StartClaimer]), BeginClaim ([dedupdriver.BeginClaimer]),
//     Batch ([dedupdriver.BatchClaimer]): the pipelined and batched paths answer
//     as the single calls do.
//   - Drain: under the inbox middleware and a Watermill router, a handler
//     that is running when the router closes finishes on a live context
//     and transaction, though the router cancelled the message's context:
//     its effect is committed once, the key is done and the message acked.
//     It runs each of the inbox's ways to a transaction (with and without
//     the attempt record, pipelined when the store can), calling
//     [TxBundle.Effect] from the handler with a transaction whose WithTx
//     returns the handler's context as it is.
//   - Misconfigured ([TxBundle.Misconfigure]): a store that cannot use
//     its own tables (missing, not granted to its user) fails every call
//     for the infrastructure's fault; under the inbox and the poison
//     middleware the message is nacked, never counted nor dead-lettered,
//     and applied once after the repair.
//   - HandOutMark (delivery.HandOutMarks): a partition without a mark
//     reads -1; a mark only rises, concurrent writers included; each
//     group, topic and partition keeps its own, long names included.
//
// # Upgrading a store's tables
//
// [RunUpgrade] takes an [UpgradeHarness] that writes records in the form
// of an earlier schema ([OldRecord]: done keys with and without failures
// before, a failed key, dead keys with and without a grant and copies, a
// start count of a process that died, a lease) and migrates the tables;
// it checks that the store answers each record as it did before.
//
// # What the lease suite checks
//
//   - ClaimComplete: a new claim carries a token and its lease's end; a
//     copy meanwhile is in flight; the token completes the key, which
//     answers done with its result and is fenced from then on; a key never
//     claimed cannot be completed, released, extended or buried.
//   - Result and Consumers, as in transactional mode.
//   - Extend: only the current token renews a lease.
//   - Release: a released key is claimable at once with a higher token,
//     its attempts counted and first failure kept; the old token is fenced.
//   - Abandon: an abandoned release takes its attempt's count back.
//   - Takeover: a lease that ends is taken over, and the first holder's
//     token is fenced: a zombie cannot complete, release, extend or bury.
//   - LateEnd: a lease that ended without being taken over still belongs
//     to its token, which completes or renews it.
//   - ConcurrentClaims: 50 copies of one key take one lease, one effect.
//   - Bury, DeadCopies, ReplayGrant, Window, Sweep, CanceledContext, Peek,
//     HasRecord, DoneKeys: as in transactional mode, with leases; Window
//     also checks that a key whose record was forgotten never gets a token
//     it had before.
//   - Cut: every call fails unavailable, and a held lease is not reported
//     lost.
package deduptest
