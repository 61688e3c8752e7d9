// Package twotier puts a fast lock (a [dedup.LeaseStore], typically
// dedup/redis) in front of a transactional record (a [dedup.TxStore],
// typically dedup/postgres), for transactional mode.
//
// The record stays the source of truth: every effect commits in the
// record's transaction together with its claim, exactly as without the
// lock. The lock only keeps duplicates off the database:
//
//   - a key the lock knows is done is answered from the lock alone, with no
//     database transaction (the lock is marked done only after the record
//     committed, so its "done" is accurate);
//   - a key another delivery is applying right now is answered
//     [dedup.StateInFlight], and the inbox nacks it after its InFlightDelay,
//     instead of parking a database connection on the row lock;
//   - only a delivery that wins the lock opens a database transaction.
//
// Dead keys are the record's alone. Burying a key and reopening it go to
// the record, and the lock never holds a dead mark: after a burial the lock
// is released, not completed, so a dead key reaches the record, which
// answers [dedup.StateDead], and a reopened key is claimable at once
// without the lock being told. [Store.InboxStart] answers a key the lock
// knows is done from the lock, and asks the record otherwise.
//
// Correctness never rests on the lock. If the lock forgets a key (a Redis
// failover or restart), the record answers it; if the lock is unreachable,
// every claim goes to the record alone, which serialises concurrent
// deliveries on its row as it always does. Use the lock with its default
// fail-closed policy: an error from it is already treated as "no lock".
//
// A lock that is down is skipped at once rather than waited for on every
// call. After [Config.BreakerFailures] calls in a row fail with
// [dedup.ErrUnavailable], a circuit breaker opens: the store stops calling
// the lock and the record decides alone. Every [Config.BreakerProbe], one
// call is let through to the lock; the first answer closes the breaker.
// The breaker probes on the calls that come, with no goroutine of its own,
// and [Stats] counts its openings and the calls it skipped. A lease taken
// just before the lock failed may outlive the outage in the lock, held by
// nobody, for a key the record completed meanwhile: for one [Config.Lease]
// after the lock last failed, an in-flight answer of the lock is checked
// against the record, which answers a key it holds done or dead.
//
//	lock, err := redis.New(redis.Config{Client: rdb})
//	record, err := postgres.New(pool, postgres.Config{})
//	store, err := twotier.New(twotier.Config{Lock: lock, Record: record})
//	inbox, err := middleware.NewInbox(middleware.InboxConfig{TxStore: store})
//
// The handler writes its effect through the record's transaction, as
// without the lock: postgres.Tx(msg.Context()).
package twotier

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"reflect"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/dedup/dedupdriver"
	"github.com/oncemill/oncemill/internal/breaker"
	"github.com/oncemill/oncemill/internal/typednil"
)

// DefaultLease is the lock's lease when [Config.Lease] is zero.
const DefaultLease = 30 * time.Second

// DefaultBreakerFailures is [Config.BreakerFailures] when it is zero.
const DefaultBreakerFailures = 3

// DefaultBreakerProbe is [Config.BreakerProbe] when it is zero.
const DefaultBreakerProbe = time.Second

// settleTimeout bounds the best-effort lock updates that run after the
// record's transaction ended, detached from the caller's cancellation, so
// that a hung Redis cannot hang a consumer's shutdown.
const settleTimeout = 5 * time.Second

// Config configures a [Store].
type Config struct {
	// Lock is the fast lock in front of the record, e.g. a dedup/redis
	// store. Required. It must be a store of its own, not Record.
	Lock dedup.LeaseStore
	// Record is the source of truth, e.g. a dedup/postgres store.
	// Required.
	Record dedup.TxStore
	// Lease is how long a claim holds the lock; it must exceed the
	// handler's longest run, or a duplicate gets past the lock and waits
	// on the record's row instead. It is also how long duplicates are
	// nacked as in flight after a process dies holding the lock (a
	// rollback or a handler error releases it at once). Defaults to
	// [DefaultLease].
	Lease time.Duration
	// BreakerFailures is how many lock calls in a row must fail with an
	// error wrapping [dedup.ErrUnavailable] (not the caller's own
	// cancellation) before the breaker opens and the lock is skipped.
	// Defaults to [DefaultBreakerFailures].
	BreakerFailures int
	// BreakerProbe is how often, while the breaker is open, one call is
	// let through to the lock to see whether it answers again; the others
	// go to the record alone. Defaults to [DefaultBreakerProbe].
	BreakerProbe time.Duration
	// Logger receives a line whenever a lock call fails and the record is
	// used alone, and when the breaker opens or closes; the calls the
	// breaker skips are not logged one by one. Defaults to
	// watermill.NopLogger.
	Logger watermill.LoggerAdapter
}

func (c Config) withDefaults() Config {
	if c.Lease == 0 {
		c.Lease = DefaultLease
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
	c = c.withDefaults()
	switch {
	case c.Lock == nil:
		return errors.New("twotier: Config.Lock is required")
	case c.Record == nil:
		return errors.New("twotier: Config.Record is required")
	case typednil.Is(c.Lock):
		return fmt.Errorf("twotier: Config.Lock holds a nil %T: pass a store made by its New", c.Lock)
	case typednil.Is(c.Record):
		return fmt.Errorf("twotier: Config.Record holds a nil %T: pass a store made by its New", c.Record)
	case sameStore(c.Lock, c.Record):
		return errors.New("twotier: Config.Lock and Config.Record are the same store: the lock must be a separate store (dedup/redis), or its lease rows would collide with the record's")
	case c.Lease < 0:
		return fmt.Errorf("twotier: Config.Lease must not be negative, got %s", c.Lease)
	case c.BreakerFailures < 0:
		return fmt.Errorf("twotier: Config.BreakerFailures must not be negative, got %d", c.BreakerFailures)
	case c.BreakerProbe < 0:
		return fmt.Errorf("twotier: Config.BreakerProbe must not be negative, got %s", c.BreakerProbe)
	}
	return nil
}

func sameStore(lock dedup.LeaseStore, record dedup.TxStore) bool {
	l, r := reflect.ValueOf(lock), reflect.ValueOf(record)
	return l.Type() == r.Type() && l.Comparable() && l.Equal(r)
}

// Stats counts what a [Store] did since it was made.
type Stats struct {
	// LockHits counts starts and claims answered by the lock alone, done
	// or in flight, without a database round trip.
	LockHits int64
	// Fallbacks counts the starts and claims made on the record alone
	// because the lock failed or its breaker was open: one or two per
	// delivery.
	Fallbacks int64
	// Skipped counts the lock calls the open breaker did not make: the
	// starts and claims among them went to the record alone, and are also
	// counted in Fallbacks.
	Skipped int64
	// BreakerOpens counts the times the breaker opened.
	BreakerOpens int64
	// BreakerOpen reports whether the breaker is open now: the lock is
	// skipped but for one probe per [Config.BreakerProbe].
	BreakerOpen bool
	// InFlightChecks counts the in-flight answers of the lock that were
	// checked against the record, because they came less than a lease
	// after the lock failed and their lease may be stale.
	InFlightChecks int64
}

// Store is a [dedup.TxStore] made of a lock and a record. Its [dedup.Graveyard]
// methods delegate to the record. It also implements [dedup.Expirer],
// [dedupdriver.Peeker] and [dedupdriver.KeyLister] by delegating to the record,
// which returns an error if the record does not. It is safe for concurrent use
// and starts no goroutines.
type Store struct {
	lock    dedup.LeaseStore
	record  dedup.TxStore
	lease   time.Duration
	logger  watermill.LoggerAdapter
	breaker *breaker.Breaker

	// epoch is when the store was made; doubtUntil, in nanoseconds since
	// epoch on the monotonic clock, is when the last lease that a failed
	// lock call may have left behind ends.
	epoch      time.Time
	doubtUntil atomic.Int64

	lockHits, fallbacks, inFlightChecks atomic.Int64
}

var (
	_ dedup.TxStore            = (*Store)(nil)
	_ dedup.Expirer            = (*Store)(nil)
	_ dedupdriver.Peeker       = (*Store)(nil)
	_ dedupdriver.RecordFinder = (*Store)(nil)
	_ dedupdriver.KeyLister    = (*Store)(nil)
)

// New returns a store for cfg; cfg is copied, defaulted and validated.
func New(cfg Config) (*Store, error) {
	cfg = cfg.withDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	return &Store{
		lock:    cfg.Lock,
		record:  cfg.Record,
		lease:   cfg.Lease,
		logger:  cfg.Logger,
		breaker: breaker.New(cfg.BreakerFailures, cfg.BreakerProbe),
		epoch:   time.Now(),
	}, nil
}

// Stats returns the store's counters.
func (s *Store) Stats() Stats {
	open, opens, skipped := s.breaker.State()
	return Stats{
		LockHits:       s.lockHits.Load(),
		Fallbacks:      s.fallbacks.Load(),
		Skipped:        skipped,
		BreakerOpens:   opens,
		BreakerOpen:    open,
		InFlightChecks: s.inFlightChecks.Load(),
	}
}

// guard runs op on the lock unless the breaker skips it, and gives the
// breaker its outcome. It reports whether op ran.
func (s *Store) guard(ctx context.Context, op func(context.Context) error) (bool, error) {
	pass, probe := s.breaker.Allow(time.Now())
	if !pass {
		return false, nil
	}
	err := op(ctx)
	s.observe(ctx, probe, err)
	return true, err
}

// observe gives the breaker the outcome of a lock call that ended with err
// and logs the breaker's change, if any.
func (s *Store) observe(ctx context.Context, probe bool, err error) {
	s.breaker.Observe(ctx, probe, err, func(err error) bool { return errors.Is(err, dedup.ErrUnavailable) }, s.logger, breaker.Lines{
		Opened: "Inbox lock unavailable: circuit breaker open, the record decides alone",
		Closed: "Inbox lock answers again: circuit breaker closed",
	})
}

// doubtLeases notes that a lock call that takes or settles a lease failed
// now: the lock may hold a lease that nobody will settle, until it ends
// one lease from now.
func (s *Store) doubtLeases(err error) {
	if errors.Is(err, dedup.ErrLeaseLost) {
		return // the lock answered: another delivery holds the key
	}
	until := int64(time.Since(s.epoch) + s.lease)
	for {
		cur := s.doubtUntil.Load()
		if cur >= until || s.doubtUntil.CompareAndSwap(cur, until) {
			return
		}
	}
}

// leasesDoubted reports whether a lease in the lock may be one that a
// failed call left behind.
func (s *Store) leasesDoubted() bool {
	return int64(time.Since(s.epoch)) < s.doubtUntil.Load()
}

// InboxBegin returns a transaction that opens nothing yet: the record's
// transaction begins only when [dedup.InboxTx.InboxClaim] finds the key new
// in the lock, and it begins on ctx, not on the claim's context, so that it
// lives as long as the caller of InboxBegin asked (see
// [dedup.TxStore.InboxBegin]).
func (s *Store) InboxBegin(ctx context.Context) (dedup.InboxTx, error) {
	return &inboxTx{s: s, begin: ctx}, nil
}

// InboxStart counts an attempt of key in the record, which answers a done
// or dead key. When the lock is a [dedupdriver.Peeker] (dedup/redis is), it is
// read first: a key it knows is done is answered from the lock alone, with
// no database round trip and no attempt counted, since the lock's "done"
// is accurate; any other answer goes to the record, which also decides
// about dead keys. A key the record answers done and the lock did not know
// is taught to the lock, so that the next duplicate stays off the
// database. If the lock fails, or its breaker is open, the record is used
// alone.
func (s *Store) InboxStart(ctx context.Context, key dedup.Key, window time.Duration) (dedup.Claim, error) {
	teach := false
	if p, ok := s.lock.(dedupdriver.Peeker); ok {
		var lc dedup.Claim
		called, err := s.guard(ctx, func(ctx context.Context) error {
			var err error
			lc, err = p.InboxPeek(ctx, key)
			return err
		})
		switch {
		case !called:
			s.fallbacks.Add(1)
		case err != nil && ctx.Err() != nil:
			return dedup.Claim{}, fmt.Errorf("twotier: start: lock peek: %w", err)
		case err != nil:
			s.fallbacks.Add(1)
			s.logger.Error("Inbox lock failed: starting on the record alone", err, fields(key))
		case lc.State == dedup.StateDone:
			s.lockHits.Add(1)
			return dedup.Claim{State: dedup.StateDone, Attempts: lc.Attempts, Result: lc.Result, FirstFailedAt: lc.FirstFailedAt}, nil
		case lc.State == dedup.StateNew:
			teach = true
		}
	}
	c, err := s.record.InboxStart(ctx, key, window)
	if err != nil {
		return dedup.Claim{}, fmt.Errorf("twotier: start: %w", err)
	}
	if teach && c.State == dedup.StateDone {
		s.teach(ctx, key, window, c.Result)
	}
	return c, nil
}

// teach marks a key the record answered done as done in the lock, best
// effort: a failure is only logged, and a lock that another delivery holds
// right now is left to it. The open breaker skips it.
func (s *Store) teach(ctx context.Context, key dedup.Key, window time.Duration, result []byte) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), settleTimeout)
	defer cancel()
	called, err := s.guard(ctx, func(ctx context.Context) error {
		lc, err := s.lock.LeaseClaim(ctx, key, s.lease, window)
		if err == nil && lc.State == dedup.StateNew {
			err = s.lock.LeaseComplete(ctx, key, lc.Token, result)
		}
		return err
	})
	if called && err != nil {
		s.doubtLeases(err)
		s.logger.Error("Inbox lock not updated with a done key", err, fields(key))
	}
}

// InboxUnstart takes back an attempt counted in the record.
func (s *Store) InboxUnstart(ctx context.Context, key dedup.Key) error {
	if err := s.record.InboxUnstart(ctx, key); err != nil {
		return fmt.Errorf("twotier: unstart: %w", err)
	}
	return nil
}

// InboxGrantReplay writes grant on a dead key in the record, which holds
// the dead marks, and reports whether the key was dead.
func (s *Store) InboxGrantReplay(ctx context.Context, key dedup.Key, grant string) (bool, error) {
	granted, err := s.record.InboxGrantReplay(ctx, key, grant)
	if err != nil {
		return false, fmt.Errorf("twotier: grant replay: %w", err)
	}
	return granted, nil
}

// InboxHasRecord reports whether the record holds key, in any state; it
// returns an error if the record is not a [dedupdriver.RecordFinder].
func (s *Store) InboxHasRecord(ctx context.Context, key dedup.Key) (bool, error) {
	f, ok := s.record.(dedupdriver.RecordFinder)
	if !ok {
		return false, fmt.Errorf("twotier: read record: the record store %T does not implement dedupdriver.RecordFinder", s.record)
	}
	found, err := f.InboxHasRecord(ctx, key)
	if err != nil {
		return false, fmt.Errorf("twotier: read record: %w", err)
	}
	return found, nil
}

// InboxReopen reopens a dead key in the record, if grant is the one
// written on it there, and reports whether it reopened it. The lock needs
// no change: it holds no dead mark, and a dead key was never marked done
// in it.
func (s *Store) InboxReopen(ctx context.Context, key dedup.Key, grant string) (bool, error) {
	reopened, err := s.record.InboxReopen(ctx, key, grant)
	if err != nil {
		return false, fmt.Errorf("twotier: reopen: %w", err)
	}
	return reopened, nil
}

// InboxReplayGranted reports whether key's record holds grant.
func (s *Store) InboxReplayGranted(ctx context.Context, key dedup.Key, grant string) (bool, error) {
	ok, err := s.record.InboxReplayGranted(ctx, key, grant)
	if err != nil {
		return false, fmt.Errorf("twotier: read replay grant: %w", err)
	}
	return ok, nil
}

// InboxDeadCopy counts a copy of a dead key in the record.
func (s *Store) InboxDeadCopy(ctx context.Context, key dedup.Key) error {
	if err := s.record.InboxDeadCopy(ctx, key); err != nil {
		return fmt.Errorf("twotier: dead copy: %w", err)
	}
	return nil
}

// InboxFail records a failed attempt in the record.
func (s *Store) InboxFail(ctx context.Context, key dedup.Key, f dedup.Failure, window time.Duration) error {
	if err := s.record.InboxFail(ctx, key, f, window); err != nil {
		return fmt.Errorf("twotier: record failure: %w", err)
	}
	return nil
}

// InboxDeleteExpired deletes expired records from the record, if it is a
// [dedup.Expirer]. The lock's records expire on their own.
func (s *Store) InboxDeleteExpired(ctx context.Context, limit int) (int, error) {
	e, ok := s.record.(dedup.Expirer)
	if !ok {
		return 0, fmt.Errorf("twotier: delete expired: Record %T does not implement dedup.Expirer", s.record)
	}
	n, err := e.InboxDeleteExpired(ctx, limit)
	if err != nil {
		return n, fmt.Errorf("twotier: delete expired: %w", err)
	}
	return n, nil
}

// InboxPeek reads key from the record, if it is a [dedupdriver.Peeker].
func (s *Store) InboxPeek(ctx context.Context, key dedup.Key) (dedup.Claim, error) {
	p, ok := s.record.(dedupdriver.Peeker)
	if !ok {
		return dedup.Claim{}, fmt.Errorf("twotier: peek: Record %T does not implement dedupdriver.Peeker", s.record)
	}
	c, err := p.InboxPeek(ctx, key)
	if err != nil {
		return dedup.Claim{}, fmt.Errorf("twotier: peek: %w", err)
	}
	return c, nil
}

// InboxDoneKeys lists the record's done keys, if it is a
// [dedupdriver.KeyLister].
func (s *Store) InboxDoneKeys(ctx context.Context, consumer string, since time.Time, fn func(key string) error) error {
	l, ok := s.record.(dedupdriver.KeyLister)
	if !ok {
		return fmt.Errorf("twotier: done keys: Record %T does not implement dedupdriver.KeyLister", s.record)
	}
	// fn's own error is returned as it is.
	return l.InboxDoneKeys(ctx, consumer, since, fn)
}

// lockState is where a transaction stands with the lock.
type lockState int

const (
	// unlocked: no lease is held (none taken yet, the lock failed or its
	// breaker skipped it, or it answered done or in flight).
	unlocked lockState = iota
	// held: the lease with token is held and must be completed or released.
	held
	// settled: the lease was completed or released.
	settled
)

// inboxTx is one claim: the lock first, the record's transaction only when
// the lock says the key is new. It is used by one goroutine.
type inboxTx struct {
	s *Store
	// begin is the context InboxBegin was given, which the record's
	// transaction is begun on: a database/sql transaction ends with it.
	begin context.Context

	key     dedup.Key
	claimed bool
	rec     dedup.InboxTx // nil until the record's transaction begins
	lock    lockState
	token   int64
	result  []byte
	ended   bool
	// buried is set by InboxBury, with the failure it recorded: the
	// commit then releases the lock instead of completing it.
	buried  bool
	failure dedup.Failure
}

func (t *inboxTx) InboxClaim(ctx context.Context, key dedup.Key, window time.Duration) (dedup.Claim, error) {
	if t.claimed {
		return dedup.Claim{}, errors.New("twotier: claim: this transaction already claimed a key")
	}
	t.claimed, t.key = true, key

	var lc dedup.Claim
	called, err := t.s.guard(ctx, func(ctx context.Context) error {
		var err error
		lc, err = t.s.lock.LeaseClaim(ctx, key, t.s.lease, window)
		return err
	})
	if err != nil {
		// The claim may have taken a lease that its reply did not bring
		// back.
		t.s.doubtLeases(err)
	}
	switch {
	case !called:
		t.s.fallbacks.Add(1) // the breaker is open: the record decides alone
	case err != nil && ctx.Err() != nil:
		return dedup.Claim{}, fmt.Errorf("twotier: lock claim: %w", err)
	case err != nil:
		t.s.fallbacks.Add(1)
		t.s.logger.Error("Inbox lock failed: claiming on the record alone", err, fields(key))
	case lc.State == dedup.StateDone:
		t.s.lockHits.Add(1)
		return dedup.Claim{State: dedup.StateDone, Attempts: lc.Attempts, Result: lc.Result, FirstFailedAt: lc.FirstFailedAt}, nil
	case lc.State == dedup.StateInFlight:
		if c, ok, err := t.checkInFlight(ctx, key); err != nil || ok {
			return c, err
		}
		t.s.lockHits.Add(1)
		return dedup.Claim{State: dedup.StateInFlight, Attempts: lc.Attempts, Until: lc.Until, FirstFailedAt: lc.FirstFailedAt}, nil
	case lc.State == dedup.StateNew:
		t.lock, t.token = held, lc.Token
	case lc.State == dedup.StateDead:
		// The lock is never buried by this store, and a dead mark in it
		// is not trusted: the record decides, without the lock.
	default:
		return dedup.Claim{}, fmt.Errorf("twotier: lock claim: unexpected state %s", lc.State)
	}

	rec, err := t.s.record.InboxBegin(t.begin)
	if err != nil {
		return dedup.Claim{}, errors.Join(fmt.Errorf("twotier: record begin: %w", err), t.end(ctx, err))
	}
	t.rec = rec
	rc, err := rec.InboxClaim(ctx, key, window)
	if err != nil {
		return dedup.Claim{}, errors.Join(fmt.Errorf("twotier: record claim: %w", err), t.end(ctx, err))
	}
	switch rc.State {
	case dedup.StateDone:
		// The lock had forgotten the key, or never learnt it: teach it, so
		// that the next duplicate stays off the database.
		t.settle(ctx, func(ctx context.Context) error {
			return t.s.lock.LeaseComplete(ctx, key, t.token, rc.Result)
		}, "Inbox lock not updated with a done key")
	case dedup.StateDead:
		// Free the lock at once, never marking it done: the next copy
		// asks the record again, which answers dead until it is reopened.
		t.releaseLock(ctx, errors.New("key is dead in the record"))
	}
	return rc, nil
}

// checkInFlight asks the record about a key the lock answered in flight,
// when that answer may come from a lease a failed lock call left behind
// (less than a lease after the failure): the delivery that took it may
// have ended, and the key been completed in the record meanwhile, by a
// delivery that went to the record alone. It reports the record's answer
// when the record holds the key done or dead; otherwise the lock's answer
// stands. A record that cannot peek is not asked.
func (t *inboxTx) checkInFlight(ctx context.Context, key dedup.Key) (dedup.Claim, bool, error) {
	p, ok := t.s.record.(dedupdriver.Peeker)
	if !ok || !t.s.leasesDoubted() {
		return dedup.Claim{}, false, nil
	}
	t.s.inFlightChecks.Add(1)
	rc, err := p.InboxPeek(ctx, key)
	if err != nil {
		return dedup.Claim{}, false, fmt.Errorf("twotier: record peek of a key in flight in the lock: %w", err)
	}
	if rc.State != dedup.StateDone && rc.State != dedup.StateDead {
		return dedup.Claim{}, false, nil
	}
	return dedup.Claim{State: rc.State, Attempts: rc.Attempts, Result: rc.Result, FirstFailedAt: rc.FirstFailedAt}, true, nil
}

// InboxBury buries the key in the record's transaction. The lock is
// released when the transaction ends, never completed, so that later
// copies reach the record and find the key dead.
func (t *inboxTx) InboxBury(ctx context.Context, key dedup.Key, f dedup.Failure) error {
	if t.rec == nil {
		return errors.New("twotier: bury: no key was claimed new in this transaction")
	}
	if err := t.rec.InboxBury(ctx, key, f); err != nil {
		return fmt.Errorf("twotier: bury: %w", err)
	}
	t.buried, t.failure = true, f
	return nil
}

func (t *inboxTx) InboxComplete(ctx context.Context, key dedup.Key, result []byte) error {
	if t.rec == nil {
		return errors.New("twotier: complete: no key was claimed new in this transaction")
	}
	if err := t.rec.InboxComplete(ctx, key, result); err != nil {
		return fmt.Errorf("twotier: complete: %w", err)
	}
	t.result = bytes.Clone(result)
	return nil
}

func (t *inboxTx) WithTx(ctx context.Context) context.Context {
	if t.rec == nil {
		return ctx
	}
	return t.rec.WithTx(ctx)
}

// Commit commits the record's transaction, then marks the key done in the
// lock, or releases the lock if the key was buried. A failure of the lock
// is only logged: the lease expires, and later duplicates find the key done
// (or dead) in the record.
func (t *inboxTx) Commit(ctx context.Context) error {
	if t.ended {
		return nil
	}
	t.ended = true
	if t.rec == nil {
		return nil // nothing was opened: the lock answered the claim
	}
	if err := t.rec.Commit(ctx); err != nil {
		// Whether or not the commit took effect, the record knows: free
		// the lock, and the redelivery asks the record.
		t.releaseLock(ctx, err)
		return fmt.Errorf("twotier: commit: %w", err)
	}
	if t.buried {
		f := t.failure
		t.settle(ctx, func(ctx context.Context) error {
			return t.s.lock.LeaseRelease(ctx, t.key, t.token, f)
		}, "Inbox lock not released after burying: the next copy waits for the lease to end")
		return nil
	}
	result := t.result
	t.settle(ctx, func(ctx context.Context) error {
		return t.s.lock.LeaseComplete(ctx, t.key, t.token, result)
	}, "Inbox lock not marked done after commit: the lease expires and duplicates go to the record")
	return nil
}

// Rollback rolls the record's transaction back, then releases the lock so
// that the redelivery can claim the key at once. It is a no-op after Commit
// or Rollback, and without a claim.
func (t *inboxTx) Rollback(ctx context.Context) error {
	if t.ended {
		return nil
	}
	return t.end(ctx, errors.New("record transaction rolled back"))
}

// end rolls back the record's transaction, if one is open, and releases the
// lock, if it is held, recording cause.
func (t *inboxTx) end(ctx context.Context, cause error) error {
	t.ended = true
	var err error
	if t.rec != nil {
		if rbErr := t.rec.Rollback(ctx); rbErr != nil {
			err = fmt.Errorf("twotier: rollback: %w", rbErr)
		}
	}
	t.releaseLock(ctx, cause)
	return err
}

func (t *inboxTx) releaseLock(ctx context.Context, cause error) {
	f := dedup.Failure{Err: cause.Error(), At: time.Now()}
	t.settle(ctx, func(ctx context.Context) error {
		return t.s.lock.LeaseRelease(ctx, t.key, t.token, f)
	}, "Inbox lock not released: the next delivery waits for the lease to end")
}

// settle completes or releases a held lease, best effort: the record has
// the outcome already, so a failure is only logged. It runs even when ctx
// is cancelled, since the record's transaction has ended either way, and
// even when the breaker is open: a lease left held answers its key in
// flight until it ends.
func (t *inboxTx) settle(ctx context.Context, op func(context.Context) error, msg string) {
	if t.lock != held {
		return
	}
	t.lock = settled
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), settleTimeout)
	defer cancel()
	err := op(ctx)
	t.s.observe(ctx, false, err)
	if err != nil {
		t.s.doubtLeases(err)
		t.s.logger.Error(msg, err, fields(t.key))
	}
}

// InboxClassify lets the record's transaction mark its driver's
// infrastructure errors among those the handler returned.
func (t *inboxTx) InboxClassify(err error) error {
	if c, ok := t.rec.(dedupdriver.Classifier); ok {
		return c.InboxClassify(err)
	}
	return err
}

func fields(key dedup.Key) watermill.LogFields {
	return watermill.LogFields{"consumer": key.Consumer, "key": key.Key}
}
