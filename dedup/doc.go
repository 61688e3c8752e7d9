// Package dedup defines the contract between the inbox middleware and the
// stores that remember which message keys a consumer has already applied.
//
// # Two modes
//
// A [TxStore] claims a key inside the database transaction that also holds
// the business effect: claim, effect, produced messages and the "done" mark
// commit together, so a crash at any point either leaves no trace or leaves
// the whole effect. This is the mode to use whenever the effect lives in the
// same database as the store.
//
// A [LeaseStore] claims a key as a fenced lease, for effects that live
// outside the database (a payment provider, an e-mail). A claim answers
// [StateNew] with a fencing token, [StateDone] with the stored result, or
// [StateInFlight] with the time the current lease ends. Only the holder of
// the current token can complete or release the key, so a process that lost
// its lease cannot overwrite the record of the one that took it over.
//
// # Implementations
//
// The postgres, sqlite and sqlstore (MySQL, MariaDB, PostgreSQL through
// database/sql) packages implement [TxStore]; postgres, redis and memory
// implement [LeaseStore]; twotier is a [TxStore] made of a lease store
// (Redis) as a fast lock in front of a [TxStore] (PostgreSQL) as the
// record. memory forgets everything on restart, and Redis alone is not a
// durable record: they exist as measured baselines and for effects whose
// own idempotency backs them, never as the only record of effects.
//
// Application code picks a store, hands it to the middlewares, and meets
// this package only in the store's type, the errors ([ErrUnavailable],
// [ErrAmbiguous], [ErrConflict], [ErrLeaseLost]) and the [Janitor].
//
// # Writing a store
//
// A store keeps the contract of this package: [TxStore] (with its
// [InboxTx]) or [LeaseStore], both with [Graveyard], and [Expirer] for the
// janitor. What a store may add beyond it, the capabilities the Bloom
// prefilter, the pipelined and batched claims and the dead-letter replay
// look for, is in [github.com/oncemill/oncemill/dedup/dedupdriver], and
// [github.com/oncemill/oncemill/dedup/deduptest] is the conformance suite
// its tests run.
//
// # Expiry
//
// Every record carries the end of its dedup window. [Expirer] deletes
// expired records one bounded batch at a time; [Janitor] runs it in the
// background and stops on Close.
package dedup
