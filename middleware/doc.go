// Package middleware holds oncemill's three Watermill router middlewares.
// Together they apply each message's effect exactly once on a broker that
// delivers at least once, and lose nothing:
//
//   - [Inbox] claims the message's key in the transaction the handler writes
//     its effect through (or as a fenced lease, for an effect outside the
//     database), runs the handler and commits claim, effect and produced
//     messages together. A duplicate does not run the handler: it gets the
//     first run's produced messages back.
//   - [Poison] retries a failed message with backoff and, after MaxAttempts
//     attempts or at once for a [Permanent] error, publishes it to a
//     dead-letter queue and only then acks it.
//   - [Bloom], optional, spares the inbox most of the cost of duplicates.
//     It is never the record.
//
// Build the inbox first and the others from it, so that they share its
// store, key function and consumer name; then add them outermost first:
//
//	inbox, err := middleware.NewInbox(middleware.InboxConfig{TxStore: store})
//	bloom, err := middleware.NewBloom(middleware.BloomConfig{Inbox: inbox})
//	poison, err := middleware.NewPoison(middleware.PoisonConfig{Inbox: inbox, Publisher: dlq, Topic: "dead-letters"})
//	router.AddMiddleware(poison.Middleware, bloom.Middleware, inbox.Middleware)
//
// Handlers stay plain functions ([message.HandlerFunc]), and in
// transactional mode write through the store's transaction
// (postgres.Tx(msg.Context())). A
// [KeyFunc] names a message's effect: [DefaultKey], or [KeyFromJSON] for a
// business key such as "orderId". An error a handler returns is retried;
// [Permanent] dead-letters it at once, and [Unavailable] says a dependency
// is down, so the attempt is neither counted nor dead-lettered.
//
// The manual says what is guaranteed and what happens to each way a
// handler can fail ([the guarantee]), which store to pick ([stores]), and
// how a dead letter is replayed ([replay]).
//
// [the guarantee]: https://github.com/oncemill/oncemill/blob/main/docs/guarantee.md
// [stores]: https://github.com/oncemill/oncemill/blob/main/docs/stores.md
// [replay]: https://github.com/oncemill/oncemill/blob/main/docs/replay.md
package middleware
