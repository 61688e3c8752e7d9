// Package redis is a lease-mode inbox store on Redis, with go-redis v9: a
// [dedup.LeaseStore], [dedupdriver.Peeker] and [dedupdriver.KeyLister].
//
// # When to use it
//
// Use it in lease mode, in front of an effect that lives outside any
// database the consumer writes to (a payment provider, an e-mail, a call to
// another service), when a claim must cost one fast round trip:
//
//	store, err := redis.New(redis.Config{Client: rdb})
//	inbox, err := middleware.NewInbox(middleware.InboxConfig{LeaseStore: store})
//
// Each claim, completion, release, extension and burial is one Lua script,
// run atomically by Redis in one round trip; lease ends are computed from
// the Redis server's clock (TIME), never from the clients' clocks. Only the
// holder of the current fencing token can complete, release, extend or bury
// a key, exactly as with the postgres store's lease mode. Tokens are the
// server's time in microseconds (or the last token + 1), so a key whose
// record expired is never given a token it had before.
//
// A buried key is dead: claims and peeks answer [dedup.StateDead], copies
// that arrive meanwhile are counted with [Store.InboxDeadCopy], and
// [Store.InboxReopen] makes it claimable again for the replay of its dead
// letter. A dead record expires with its window, like a done one.
//
// # What it risks
//
// Redis is not a durable record. A failover to a replica that had not yet
// received the write, a restart without persistence, or an eviction forgets
// that a key is done, and the next delivery of that key applies the effect
// again. Run Redis with maxmemory-policy noeviction (the store never lets a
// record be evicted on purpose: a full Redis refuses the claim instead), with
// persistence if a restart must not forget, and keep the key's own
// idempotency mechanism on the effect (pass middleware.IdempotencyKey to the
// provider) where there is one.
//
// With [FailOpen], messages are processed without any dedup while Redis is
// unreachable: every delivery in that time applies its effect, duplicates
// included. [FailClosed], the default, nacks them instead, so the broker
// redelivers once Redis is back. Under FailOpen a circuit breaker keeps a
// Redis that is down from slowing every delivery down: after
// [Config.BreakerFailures] unavailable claims or peeks in a row they fail
// open at once, without Redis, but for one probe per [Config.BreakerProbe],
// until Redis answers again.
//
// This store is therefore not a source of truth. When the effect lives in
// PostgreSQL, use dedup/twotier: Redis as a fast lock in front of the
// PostgreSQL record, which stays the truth.
//
// # Layout
//
// Each (consumer, key) is one hash at <Prefix>{<consumer>}:<key>, where the
// consumer is escaped so that it holds no '{', '}' or glob metacharacter:
// the braces are a cluster hash tag that keeps a consumer's keys in one slot,
// and two different pairs never share a Redis key. The hash expires (PEXPIRE)
// the dedup window after the claim that created or took over its lease. Its
// fields are status (processing, failed, done or dead), token, lease_until,
// attempts, result, done_at, first_error, first_failed_at, last_error,
// last_failed_at and dead_copies.
//
// The store does not own the client: closing it is the caller's business,
// and the store has no Close method. It starts no goroutines.
package redis
