// Package reconcile checks end to end that every event the outbox relay
// published reached a consumer: it compares the relay's ledger
// (forwarder.RelayConfig.Ledger) with the consumer's inbox and its
// entries in the dead-letter table, and reports each event published in
// a window that the consumer holds neither as done nor as dead, lost (no
// inbox row for its key) or stuck (its key processing or failed). Strict
// also reports the keys done in the inbox that no ledger row explains.
//
// It is the check `oncemill reconcile` runs from a cron job or a CI step,
// and the one the console's overview shows (console.Config.Reconcile).
//
// The key compared is the one the inbox's default KeyFunc derives: the
// idempotency_key metadata, else the message UUID; a consumer with
// another KeyFunc cannot be reconciled so. A consumer reads some topics
// of those the relay publishes: give them in [Config.Topics], or every
// event of the other topics is reported lost.
package reconcile
