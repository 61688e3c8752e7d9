// Package dedupdriver holds what only a store's author and oncemill's own
// middlewares need: the optional capabilities a [dedup] store implements
// beyond its contract, which the inbox, the Bloom prefilter and the
// dead-letter replay find by type assertion. Application code never names
// them; it hands a store to the middlewares and they ask.
//
// # Writing a store
//
// A store author reads three packages, in this order:
//
//   - [dedup]: the contract every store keeps, [dedup.TxStore] (with its
//     [dedup.InboxTx]) or [dedup.LeaseStore], both with [dedup.Graveyard],
//     and [dedup.Expirer] for the janitor; the errors of the
//     infrastructure a store wraps ([dedup.ErrUnavailable],
//     [dedup.ErrAmbiguous], [dedup.ErrConflict]).
//   - dedupdriver, this package: what a store may add. [Peeker] and
//     [KeyLister] serve the Bloom prefilter and the in-flight wait;
//     [RecordFinder] lets a replay tell a key with no record from one that
//     is done; [Classifier], on a transaction, tells the inbox that a
//     handler's error came from a connection lost under it, and
//     [AbortReporter] that a handler left its transaction aborted;
//     [StartClaimer], [BeginClaimer] and [BatchClaimer] save round trips
//     (InboxConfig.Tuning.Pipeline and InboxConfig.Tuning.Batch need them).
//   - deduptest: the conformance suite the store's tests run, which checks
//     the contract and each capability the store implements.
//
// Without a capability the middleware that needs it refuses to be built
// (a Bloom prefilter without a [Peeker], a batching inbox without a
// [BatchClaimer]) or does without what it saves (a Pipeline without
// [StartClaimer] makes its calls one by one).
package dedupdriver
