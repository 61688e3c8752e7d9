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
// The postgres and sqlite packages implement [TxStore]; postgres, redis and
// memory implement [LeaseStore]; twotier is a [TxStore] made of a lease
// store (Redis) as a fast lock in front of a [TxStore] (PostgreSQL) as the
// record. All of them implement [Peeker] and [KeyLister] for the Bloom
// prefilter. memory forgets everything on restart, and Redis alone is not a
// durable record: they exist as measured baselines and for effects whose
// own idempotency backs them, never as the only record of effects.
//
// # Expiry
//
// Every record carries the end of its dedup window. [Expirer] deletes
// expired records one bounded batch at a time; [Janitor] runs it in the
// background and stops on Close.
package dedup
