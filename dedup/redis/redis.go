package redis

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	goredis "github.com/redis/go-redis/v9"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/dedup/dedupdriver"
	"github.com/oncemill/oncemill/internal/breaker"
)

// DefaultPrefix starts every Redis key the store writes when
// [Config.Prefix] is empty.
const DefaultPrefix = "oncemill:"

// DefaultBreakerFailures is [Config.BreakerFailures] when it is zero.
const DefaultBreakerFailures = 3

// DefaultBreakerProbe is [Config.BreakerProbe] when it is zero.
const DefaultBreakerProbe = time.Second

// ErrUnavailable is wrapped by the errors returned while Redis cannot be
// reached or cannot serve the command (connection refused or lost, timeout,
// pool exhausted, LOADING, READONLY, OOM…), under [FailClosed], or by
// [Store.InboxDoneKeys] under either policy. The message should be nacked
// and retried later. Errors that are not wrapped with it (a script error, a
// key of the wrong type, a refused password) will not go away by retrying.
var ErrUnavailable error = unavailableError{}

// unavailableError is [ErrUnavailable]: it also matches
// dedup.ErrUnavailable, so that the middlewares see an outage whatever the
// store.
type unavailableError struct{}

func (unavailableError) Error() string { return "redis: server unavailable" }

func (unavailableError) Is(target error) bool { return target == dedup.ErrUnavailable }

// Policy says what the store does while Redis is unavailable.
type Policy int

const (
	// FailClosed returns every unavailability error, wrapped with
	// [ErrUnavailable], so that the inbox nacks the message and the broker
	// redelivers it once Redis is back. No effect is applied without a
	// claim. It is the default.
	FailClosed Policy = iota
	// FailOpen lets messages through while Redis is unavailable:
	// [Store.LeaseClaim] and [Store.InboxPeek] answer [dedup.StateNew]
	// with token 0, and completing, releasing, extending or burying token
	// 0 does nothing (so a key buried then is not remembered dead). The
	// effect of every delivery in that time is applied, duplicates
	// included. Each such answer is counted in [Stats.FailedOpen] and
	// logged at error level with its cause.
	//
	// A Redis that is down is not waited for on every claim: after
	// [Config.BreakerFailures] claims and peeks in a row found it
	// unavailable, a circuit breaker opens and they fail open at once,
	// without calling Redis, but for one per [Config.BreakerProbe] that
	// is let through to see whether Redis answers again; the first answer
	// closes the breaker.
	FailOpen
)

// String returns the policy's name.
func (p Policy) String() string {
	switch p {
	case FailClosed:
		return "fail_closed"
	case FailOpen:
		return "fail_open"
	default:
		return "Policy(" + strconv.Itoa(int(p)) + ")"
	}
}

// Config configures a [Store].
type Config struct {
	// Client is the Redis client (a *goredis.Client, *goredis.ClusterClient,
	// failover client…). Required. The store does not close it.
	Client goredis.UniversalClient
	// Prefix starts every key the store writes; it must not contain '{'
	// or '}', which would move the cluster hash tag. Defaults to
	// [DefaultPrefix].
	Prefix string
	// Policy says what to do while Redis is unavailable. Defaults to
	// [FailClosed].
	Policy Policy
	// BreakerFailures is, under [FailOpen], how many claims and peeks in a
	// row must find Redis unavailable (not the caller's own cancellation)
	// before the breaker opens and they fail open without calling Redis.
	// [FailClosed] calls Redis every time. Defaults to
	// [DefaultBreakerFailures].
	BreakerFailures int
	// BreakerProbe is, under [FailOpen], how often one claim or peek is
	// let through to Redis while the breaker is open. Defaults to
	// [DefaultBreakerProbe].
	BreakerProbe time.Duration
	// Logger receives a line for every fail-open answer, and when the
	// breaker opens or closes. Defaults to watermill.NopLogger.
	Logger watermill.LoggerAdapter
}

func (c Config) withDefaults() Config {
	if c.Prefix == "" {
		c.Prefix = DefaultPrefix
	}
	if c.BreakerFailures == 0 {
		c.BreakerFailures = DefaultBreakerFailures
	}
	if c.BreakerProbe == 0 {
		c.BreakerProbe = DefaultBreakerProbe
	}
	if c.Logger == nil {
		c.Logger = watermill.NopLogger{}
	}
	return c
}

// Validate reports the first field that is missing or out of range; the
// error names it.
func (c Config) Validate() error {
	switch {
	case c.Client == nil:
		return errors.New("redis: Config.Client is required")
	case strings.ContainsAny(c.Prefix, "{}"):
		return fmt.Errorf("redis: Config.Prefix must not contain '{' or '}', got %q", c.Prefix)
	case c.Policy != FailClosed && c.Policy != FailOpen:
		return fmt.Errorf("redis: Config.Policy must be FailClosed or FailOpen, got %s", c.Policy)
	case c.BreakerFailures < 0:
		return fmt.Errorf("redis: Config.BreakerFailures must not be negative, got %d", c.BreakerFailures)
	case c.BreakerProbe < 0:
		return fmt.Errorf("redis: Config.BreakerProbe must not be negative, got %s", c.BreakerProbe)
	}
	return nil
}

// Stats counts what a [Store] did since it was made.
type Stats struct {
	// FailedOpen counts the claims and peeks answered [dedup.StateNew]
	// without Redis under [FailOpen], those the breaker skipped included.
	FailedOpen int64
	// Skipped counts the claims and peeks that failed open without
	// calling Redis because the breaker was open; they are also counted
	// in FailedOpen.
	Skipped int64
	// BreakerOpens counts the times the breaker opened.
	BreakerOpens int64
	// BreakerOpen reports whether the breaker is open now: claims and
	// peeks fail open without Redis but for one probe per
	// [Config.BreakerProbe].
	BreakerOpen bool
}

// Store keeps one Redis hash per (consumer, key). It implements
// [dedup.LeaseStore], [dedupdriver.Peeker] and [dedupdriver.KeyLister], is safe
// for concurrent use, and starts no goroutines. Records expire by themselves
// (PEXPIRE), so it needs no janitor.
type Store struct {
	client goredis.UniversalClient
	prefix string
	policy Policy
	logger watermill.LoggerAdapter

	claim, complete, release, bury, extend *goredis.Script
	peek, reopen, deadCopy, grant          *goredis.Script

	// breaker guards claims and peeks under FailOpen; openErr is the cause
	// logged for the answers it fails open.
	breaker *breaker.Breaker
	openErr error

	failedOpen atomic.Int64
}

var (
	_ dedup.LeaseStore         = (*Store)(nil)
	_ dedupdriver.Peeker       = (*Store)(nil)
	_ dedupdriver.RecordFinder = (*Store)(nil)
	_ dedupdriver.KeyLister    = (*Store)(nil)
)

// New returns a store on cfg.Client; cfg is copied, defaulted and
// validated. It makes no call to Redis.
func New(cfg Config) (*Store, error) {
	cfg = cfg.withDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	return &Store{
		client:   cfg.Client,
		prefix:   cfg.Prefix,
		policy:   cfg.Policy,
		logger:   cfg.Logger,
		claim:    goredis.NewScript(claimSource),
		complete: goredis.NewScript(completeSource),
		release:  goredis.NewScript(releaseSource),
		bury:     goredis.NewScript(burySource),
		extend:   goredis.NewScript(extendSource),
		peek:     goredis.NewScript(peekSource),
		reopen:   goredis.NewScript(reopenSource),
		deadCopy: goredis.NewScript(deadCopySource),
		grant:    goredis.NewScript(grantSource),
		breaker:  breaker.New(cfg.BreakerFailures, cfg.BreakerProbe),
		openErr: fmt.Errorf("redis: circuit breaker open after %d unavailable calls in a row, Redis probed every %s: %w",
			cfg.BreakerFailures, cfg.BreakerProbe, ErrUnavailable),
	}, nil
}

// Stats returns the store's counters.
func (s *Store) Stats() Stats {
	open, opens, skipped := s.breaker.State()
	return Stats{FailedOpen: s.failedOpen.Load(), Skipped: skipped, BreakerOpens: opens, BreakerOpen: open}
}

// allow asks the breaker whether a claim or peek may call Redis, under
// FailOpen; under FailClosed every call does.
func (s *Store) allow() (pass, probe bool) {
	if s.policy != FailOpen {
		return true, false
	}
	return s.breaker.Allow(time.Now())
}

// observe gives the breaker, under FailOpen, the outcome of a claim or
// peek that called Redis and ended with err, and logs its change, if any.
func (s *Store) observe(ctx context.Context, probe bool, err error) {
	if s.policy != FailOpen {
		return
	}
	s.breaker.Observe(ctx, probe, err, unavailable, s.logger, breaker.Lines{
		Opened: "Redis unavailable: circuit breaker open, claims and peeks fail open without calling Redis",
		Closed: "Redis answers again: circuit breaker closed",
	})
}

// skipped answers a claim or peek that the open breaker kept from Redis,
// as failOpen does.
func (s *Store) skipped(op string, key dedup.Key) dedup.Claim {
	s.failedOpen.Add(1)
	s.logger.Error("Redis unavailable: failing open, the message is processed without dedup", s.openErr, watermill.LogFields{
		"op": op, "consumer": key.Consumer, "key": key.Key, "breaker": "open",
	})
	return dedup.Claim{State: dedup.StateNew}
}

// LeaseClaim takes key for lease unless it is done, dead or held by a live
// lease. A new claim counts an attempt, issues a token higher than any
// earlier one of the key (the server's time in microseconds, or the last
// token + 1 if that is higher), and sets the record to expire window (or
// lease, if longer) from now. Every answer carries the time of the key's
// first recorded failure, if any.
func (s *Store) LeaseClaim(ctx context.Context, key dedup.Key, lease, window time.Duration) (dedup.Claim, error) {
	if lease <= 0 || window <= 0 {
		return dedup.Claim{}, fmt.Errorf("redis: lease claim: lease and window must be positive, got %s and %s", lease, window)
	}
	ttl := max(window, lease) // a record must outlive its lease, or a zombie's token could be reissued
	pass, probe := s.allow()
	if !pass {
		return s.skipped("lease claim", key), nil
	}
	reply, err := s.claim.Run(ctx, s.client, []string{s.recordKey(key)}, millis(lease), millis(ttl)).Slice()
	s.observe(ctx, probe, err)
	if err != nil {
		if s.failOpen(ctx, "lease claim", key, err) {
			return dedup.Claim{State: dedup.StateNew}, nil
		}
		return dedup.Claim{}, s.wrap(ctx, "lease claim", err)
	}
	f := fields(reply, 5)
	c := dedup.Claim{Attempts: int(f.int(1)), FirstFailedAt: f.time(4)}
	switch state := f.str(0); state {
	case "new":
		c.State, c.Token, c.Until = dedup.StateNew, f.int(2), f.time(3)
	case "in_flight":
		c.State, c.Until = dedup.StateInFlight, f.time(3)
	case "done":
		c.State, c.Result = dedup.StateDone, f.bytes(5)
	case "dead":
		c.State = dedup.StateDead
	default:
		f.fail(fmt.Errorf("unexpected state %q", state))
	}
	if f.err != nil {
		return dedup.Claim{}, fmt.Errorf("redis: lease claim: %w", f.err)
	}
	return c, nil
}

// LeaseComplete marks key done with result if token is still current. A
// nil result stores none, and a later claim answers a nil Result.
func (s *Store) LeaseComplete(ctx context.Context, key dedup.Key, token int64, result []byte) error {
	if token == 0 && s.policy == FailOpen {
		return nil // the claim failed open: there is no lease to complete
	}
	stored := "0"
	if result != nil {
		stored = "1"
	}
	return s.end(ctx, "lease complete", s.complete, key, strconv.FormatInt(token, 10), result, stored)
}

// LeaseRelease marks key failed, claimable at once, if token is still
// current, and records f; the first failure's text and time are kept. An
// abandoned attempt ([dedup.Failure.Abandoned]) records no failure, and its
// count is taken back.
func (s *Store) LeaseRelease(ctx context.Context, key dedup.Key, token int64, f dedup.Failure) error {
	if token == 0 && s.policy == FailOpen {
		return nil // the claim failed open: there is no lease to release
	}
	abandoned := "0"
	if f.Abandoned {
		abandoned = "1"
	}
	return s.end(ctx, "lease release", s.release, key, strconv.FormatInt(token, 10), f.Err, failedAt(f), abandoned)
}

// LeaseBury marks key dead if token is still current, and records f as
// LeaseRelease does. Claims and peeks answer [dedup.StateDead] until
// [Store.InboxReopen]; the record keeps its expiry, like a done one.
func (s *Store) LeaseBury(ctx context.Context, key dedup.Key, token int64, f dedup.Failure) error {
	if token == 0 && s.policy == FailOpen {
		return nil // the claim failed open: there is no lease to bury
	}
	return s.end(ctx, "lease bury", s.bury, key, strconv.FormatInt(token, 10), f.Err, failedAt(f))
}

// failedAt is f's time in milliseconds, or "" for the server's time.
func failedAt(f dedup.Failure) string {
	if f.At.IsZero() {
		return ""
	}
	return strconv.FormatInt(f.At.UnixMilli(), 10)
}

// LeaseExtend moves the end of token's lease to lease from now, on the
// server's clock, if token is still current, and returns it; the record is
// kept at least until then. Under [FailOpen], token 0 is extended without
// Redis, on the local clock.
func (s *Store) LeaseExtend(ctx context.Context, key dedup.Key, token int64, lease time.Duration) (time.Time, error) {
	if lease <= 0 {
		return time.Time{}, fmt.Errorf("redis: lease extend: lease must be positive, got %s", lease)
	}
	if token == 0 && s.policy == FailOpen {
		return time.Now().Add(lease), nil // the claim failed open: there is no lease to extend
	}
	until, err := s.extend.Run(ctx, s.client, []string{s.recordKey(key)}, strconv.FormatInt(token, 10), millis(lease)).Int64()
	if err != nil {
		return time.Time{}, s.wrap(ctx, "lease extend", err)
	}
	if until == 0 {
		return time.Time{}, fmt.Errorf("redis: lease extend: consumer %q key %q: %w", key.Consumer, key.Key, dedup.ErrLeaseLost)
	}
	return time.UnixMilli(until), nil
}

// InboxGrantReplay writes grant on key's record if the key is dead, in
// the record's replay_grant field, and reports whether it was dead. It
// never fails open.
func (s *Store) InboxGrantReplay(ctx context.Context, key dedup.Key, grant string) (bool, error) {
	if grant == "" {
		return false, fmt.Errorf("redis: grant replay of consumer %q key %q: %w", key.Consumer, key.Key, dedup.ErrNoGrant)
	}
	n, err := s.grant.Run(ctx, s.client, []string{s.recordKey(key)}, grant).Int64()
	if err != nil {
		return false, s.wrap(ctx, "grant replay", err)
	}
	return n == 1, nil
}

// InboxReopen makes a dead key claimable again, as a failed key with no
// attempts, if grant is the one written on it, and reports whether it
// reopened it. Its failure history and expiry stay. It never fails open.
func (s *Store) InboxReopen(ctx context.Context, key dedup.Key, grant string) (bool, error) {
	if grant == "" {
		return false, nil
	}
	n, err := s.reopen.Run(ctx, s.client, []string{s.recordKey(key)}, grant).Int64()
	if err != nil {
		return false, s.wrap(ctx, "reopen", err)
	}
	return n == 1, nil
}

// InboxReplayGranted reports whether key's record holds grant. It never
// fails open.
func (s *Store) InboxReplayGranted(ctx context.Context, key dedup.Key, grant string) (bool, error) {
	if grant == "" {
		return false, nil
	}
	got, err := s.client.HGet(ctx, s.recordKey(key), "replay_grant").Result()
	if errors.Is(err, goredis.Nil) {
		return false, nil
	}
	if err != nil {
		return false, s.wrap(ctx, "read replay grant", err)
	}
	return got == grant, nil
}

// InboxHasRecord reports whether key has a record, in any state; Redis
// has deleted the records that expired. It never fails open.
func (s *Store) InboxHasRecord(ctx context.Context, key dedup.Key) (bool, error) {
	n, err := s.client.Exists(ctx, s.recordKey(key)).Result()
	if err != nil {
		return false, s.wrap(ctx, "read record", err)
	}
	return n == 1, nil
}

// InboxDeadCopy counts a copy of a dead key in the record's dead_copies
// field; it does nothing to a key that is not dead. It never fails open.
func (s *Store) InboxDeadCopy(ctx context.Context, key dedup.Key) error {
	if err := s.deadCopy.Run(ctx, s.client, []string{s.recordKey(key)}).Err(); err != nil {
		return s.wrap(ctx, "dead copy", err)
	}
	return nil
}

func (s *Store) end(ctx context.Context, op string, script *goredis.Script, key dedup.Key, args ...any) error {
	n, err := script.Run(ctx, s.client, []string{s.recordKey(key)}, args...).Int64()
	if err != nil {
		// Completing or releasing never fails open: the lease is still
		// held, and it expires by itself once Redis is back.
		return s.wrap(ctx, op, err)
	}
	if n == 0 {
		return fmt.Errorf("redis: %s: consumer %q key %q: %w", op, key.Consumer, key.Key, dedup.ErrLeaseLost)
	}
	return nil
}

// InboxPeek reads key's record without claiming it, in one round trip that
// writes nothing. Under [FailOpen] an unavailable Redis answers
// [dedup.StateNew].
func (s *Store) InboxPeek(ctx context.Context, key dedup.Key) (dedup.Claim, error) {
	pass, probe := s.allow()
	if !pass {
		return s.skipped("peek", key), nil
	}
	reply, err := s.peek.Run(ctx, s.client, []string{s.recordKey(key)}).Slice()
	s.observe(ctx, probe, err)
	if err != nil {
		if s.failOpen(ctx, "peek", key, err) {
			return dedup.Claim{State: dedup.StateNew}, nil
		}
		return dedup.Claim{}, s.wrap(ctx, "peek", err)
	}
	f := fields(reply, 4)
	c := dedup.Claim{Attempts: int(f.int(1)), FirstFailedAt: f.time(3)}
	switch state := f.str(0); state {
	case "new":
		c.State = dedup.StateNew
	case "in_flight":
		c.State, c.Until = dedup.StateInFlight, f.time(2)
	case "done":
		c.State, c.Result = dedup.StateDone, f.bytes(4)
	case "dead":
		c.State = dedup.StateDead
	default:
		f.fail(fmt.Errorf("unexpected state %q", state))
	}
	if f.err != nil {
		return dedup.Claim{}, fmt.Errorf("redis: peek: %w", f.err)
	}
	return c, nil
}

// scanCount is the COUNT hint of each SCAN: how many keys Redis looks at per
// round trip.
const scanCount = 500

// InboxDoneKeys calls fn with every key of consumer completed at or after
// since (to the millisecond) that has not expired. It walks the consumer's
// keys with SCAN, scanCount at a time, and reads their status in one
// pipeline per batch, so memory does not grow with the number of keys.
// SCAN may return a key twice while Redis rehashes, so fn may see a key
// twice. It never fails open: an unavailable Redis returns an error
// wrapping [ErrUnavailable] under either policy.
func (s *Store) InboxDoneKeys(ctx context.Context, consumer string, since time.Time, fn func(key string) error) error {
	prefix := s.consumerPrefix(consumer)
	// The hash tag in the pattern holds no metacharacter, so go-redis
	// routes the SCAN to the node that owns the consumer's slot.
	match := globEscape(prefix) + "*"
	sinceMs := since.UnixMilli()
	var cursor uint64
	for {
		if err := ctx.Err(); err != nil {
			return err
		}
		keys, next, err := s.client.Scan(ctx, cursor, match, scanCount).Result()
		if err != nil {
			return s.wrap(ctx, "done keys: scan", err)
		}
		if err := s.emitDone(ctx, prefix, keys, sinceMs, fn); err != nil {
			return err
		}
		if next == 0 {
			return nil
		}
		cursor = next
	}
}

func (s *Store) emitDone(ctx context.Context, prefix string, keys []string, sinceMs int64, fn func(string) error) error {
	if len(keys) == 0 {
		return nil
	}
	cmds := make([]*goredis.SliceCmd, len(keys))
	// The pipeline's own error is that of its first failed command; each
	// command reports its own below, so that a stray key of another type
	// under the prefix is skipped rather than fatal.
	_, pipeErr := s.client.Pipelined(ctx, func(p goredis.Pipeliner) error {
		for i, k := range keys {
			cmds[i] = p.HMGet(ctx, k, "status", "done_at")
		}
		return nil
	})
	for i, k := range keys {
		vals, err := cmds[i].Result()
		if isWrongType(err) {
			continue // not one of the store's hashes
		}
		if err == nil && len(vals) < 2 {
			err = pipeErr
			if err == nil {
				err = fmt.Errorf("short HMGET reply %v", vals)
			}
		}
		if err != nil {
			return s.wrap(ctx, "done keys: read", err)
		}
		status, _ := vals[0].(string)
		doneAt, _ := vals[1].(string)
		if status != "done" {
			continue
		}
		if ms, err := strconv.ParseInt(doneAt, 10, 64); err != nil || ms < sinceMs {
			continue
		}
		if err := fn(strings.TrimPrefix(k, prefix)); err != nil {
			return err
		}
	}
	return nil
}

func isWrongType(err error) bool {
	return goredis.HasErrorPrefix(err, "WRONGTYPE")
}

// recordKey is <prefix>{<escaped consumer>}:<key>. The escaped consumer
// holds no '{' or '}', so the hash tag is exactly the consumer and the key
// can be read back after the first "}:".
func (s *Store) recordKey(k dedup.Key) string {
	return s.consumerPrefix(k.Consumer) + k.Key
}

func (s *Store) consumerPrefix(consumer string) string {
	return s.prefix + "{" + escapeConsumer(consumer) + "}:"
}

// consumerSpecial are the bytes escaped in a consumer name: the escape byte
// itself, the hash tag's braces, and the glob metacharacters of SCAN MATCH,
// so that the hash tag of a SCAN pattern is the same as its keys'.
const consumerSpecial = `%{}*?[]\`

// escapeConsumer percent-encodes consumerSpecial. Escaping the escape byte
// makes it injective: two names never share an escaped form.
func escapeConsumer(c string) string {
	if !strings.ContainsAny(c, consumerSpecial) {
		return c
	}
	var b strings.Builder
	for i := 0; i < len(c); i++ {
		if strings.IndexByte(consumerSpecial, c[i]) >= 0 {
			fmt.Fprintf(&b, "%%%02X", c[i])
			continue
		}
		b.WriteByte(c[i])
	}
	return b.String()
}

// globEscape makes s match itself literally in a SCAN MATCH pattern.
func globEscape(s string) string {
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		switch s[i] {
		case '*', '?', '[', ']', '\\':
			b.WriteByte('\\')
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// failOpen reports whether err is to be answered as a new key: the policy
// is FailOpen and err means Redis is unavailable. It counts and logs it.
func (s *Store) failOpen(ctx context.Context, op string, key dedup.Key, err error) bool {
	if s.policy != FailOpen || ctx.Err() != nil || !unavailable(err) {
		return false
	}
	s.failedOpen.Add(1)
	s.logger.Error("Redis unavailable: failing open, the message is processed without dedup", err, watermill.LogFields{
		"op": op, "consumer": key.Consumer, "key": key.Key,
	})
	return true
}

// wrap prefixes err with the operation and, when it means Redis is
// unavailable, wraps ErrUnavailable. The caller's own cancellation is not
// unavailability.
func (s *Store) wrap(ctx context.Context, op string, err error) error {
	if ctx.Err() == nil && unavailable(err) {
		return fmt.Errorf("redis: %s: %w: %w", op, ErrUnavailable, err)
	}
	return fmt.Errorf("redis: %s: %w", op, err)
}

// unavailable reports whether err means that Redis could not serve the
// command rather than that the command is wrong. Anything that is not an
// error reply from the server (network errors, timeouts, io.EOF, a pool
// timeout, a closed client) is unavailability; of the error replies, only
// those a healthy server would not give are.
func unavailable(err error) bool {
	var reply goredis.Error
	if !errors.As(err, &reply) {
		return true
	}
	// The codes of a server that cannot serve now: loading its data set,
	// a replica, a master without its replicas, a cluster without quorum,
	// out of memory under noeviction, busy running a long script, refusing
	// writes because it cannot persist, or full of clients.
	codes := [...]string{
		"LOADING ", "READONLY ", "MASTERDOWN ", "CLUSTERDOWN ", "TRYAGAIN ", "NOREPLICAS ",
		"OOM ", "BUSY ", "MISCONF ", "ERR max number of clients reached",
	}
	msg := reply.Error()
	for _, code := range codes {
		// Redis 7 passes a script's failed call on with its own code;
		// Redis 6 wraps it: "ERR Error running script …: -READONLY …".
		if strings.HasPrefix(msg, code) || strings.Contains(msg, "-"+code) {
			return true
		}
	}
	return false
}

func millis(d time.Duration) int64 {
	ms := d.Milliseconds()
	if ms < 1 {
		ms = 1
	}
	return ms
}

// reply reads a script's array reply; the first error sticks, and a
// missing or mistyped field reads as its zero value.
type reply struct {
	vals []any
	err  error
}

// fields wraps vals, which must hold at least n fields.
func fields(vals []any, n int) *reply {
	r := &reply{vals: vals}
	if len(vals) < n {
		r.fail(fmt.Errorf("script reply %v has %d fields, want at least %d", vals, len(vals), n))
	}
	return r
}

func (r *reply) fail(err error) {
	if r.err == nil {
		r.err = err
	}
}

func (r *reply) at(i int) any {
	if i >= len(r.vals) {
		return nil
	}
	return r.vals[i]
}

func (r *reply) str(i int) string {
	s, ok := r.at(i).(string)
	if !ok {
		r.fail(fmt.Errorf("script reply field %d is %T, not a string", i, r.at(i)))
	}
	return s
}

func (r *reply) int(i int) int64 {
	n, ok := r.at(i).(int64)
	if !ok {
		r.fail(fmt.Errorf("script reply field %d is %T, not an integer", i, r.at(i)))
	}
	return n
}

// time returns field i, Unix milliseconds, as a time; 0 is the zero time.
func (r *reply) time(i int) time.Time {
	ms := r.int(i)
	if ms == 0 {
		return time.Time{}
	}
	return time.UnixMilli(ms)
}

// bytes returns field i as bytes, or nil when it is absent or nil.
func (r *reply) bytes(i int) []byte {
	v := r.at(i)
	if v == nil {
		return nil
	}
	s, ok := v.(string)
	if !ok {
		r.fail(fmt.Errorf("script reply field %d is %T, not a string", i, v))
	}
	return []byte(s)
}
