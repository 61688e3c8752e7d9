// Package middleware holds oncemill's Watermill router middlewares.
//
// # Inbox
//
// [Inbox] applies each message key's effect exactly once per consumer on a
// broker that delivers at least once. Add it like any Watermill middleware;
// handlers stay plain [message.HandlerFunc]s:
//
//	inbox, err := middleware.NewInbox(middleware.InboxConfig{TxStore: store})
//	router.AddMiddleware(inbox.Middleware)
//
// In transactional mode ([InboxConfig.TxStore]) the key is claimed in a
// database transaction that the handler also writes its effect through
// (postgres.Tx(msg.Context()) or sqlite.Tx(msg.Context())); claim, effect,
// produced messages and the done mark commit together. In lease mode
// ([InboxConfig.LeaseStore]) the key is claimed as a fenced lease for effects
// outside the database, and [IdempotencyKey] hands the key to the effect.
//
// A duplicate of a done key does not run the handler: the inbox returns the
// messages the first run produced, with their UUIDs, so that a crash between
// commit and publish loses nothing and the next consumer can deduplicate.
//
// # Keys
//
// A [KeyFunc] names a message's effect: [DefaultKey] (metadata
// "idempotency_key", else the UUID), [KeyFromMetadata], [KeyFromJSON] for a
// business key such as "orderId", [KeyFromHash]. A message without a usable
// key fails with a [Permanent] error wrapping [ErrKey]: it is never applied
// unguarded.
//
// # Poison messages
//
// [Poison] goes in front of the inbox: a failed message is retried with
// backoff and, after MaxAttempts attempts (counted durably by the inbox's
// store or the broker) or at once for a [Permanent] error, published to a
// dead-letter queue with the reason, and only then acked. If the
// dead-letter publish fails, the message is nacked: nothing is lost.
//
//	router.AddMiddleware(poison.Middleware, inbox.Middleware)
//
// # Failures other than an error
//
// A panic is recovered by the inbox (or by Poison when there is no inbox)
// and counted as a failed attempt wrapping [ErrPanicked]. A deadline
// exceeded, such as Watermill's Timeout middleware sets, is counted too;
// only the consumer shutting down is not ([ErrShutdown]): work that
// finished is committed on a context detached from the message's
// cancellation and bounded by [InboxConfig.FinishTimeout], and an attempt
// cut short is rolled back without counting. The inbox records each
// attempt before its handler runs, so a message whose deliveries kill the
// process is dead-lettered after MaxAttempts without running again
// ([ErrCrashLoop]). In lease mode the lease is renewed while the handler
// runs, and [LeaseToken] hands its fencing token to the effect.
//
// When Poison dead-letters a key that went through the inbox, the key is
// recorded dead; later copies are acked without running until the dead
// letter is replayed.
//
// # Bloom prefilter
//
// [Bloom] goes between the two and spares the inbox the cost of
// duplicates: a key it has surely never seen goes straight to the inbox, a
// key it may have seen is read from the store first and, if done, answered
// with its stored result. The filter is never the record.
//
//	router.AddMiddleware(poison.Middleware, bloom.Middleware, inbox.Middleware)
//
// # Errors
//
// Handler errors are returned unchanged (the message is nacked); wrap one
// with [Permanent] when retrying cannot help. [IsPermanent] tells them apart.
package middleware
