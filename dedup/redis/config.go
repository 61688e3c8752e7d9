package redis

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	goredis "github.com/redis/go-redis/v9"

	"github.com/oncemill/oncemill/internal/typednil"
)

// DefaultPrefix starts every Redis key the store writes when
// [Config.Prefix] is empty.
const DefaultPrefix = "oncemill:"

// DefaultBreakerFailures is [Config.BreakerFailures] when it is zero.
const DefaultBreakerFailures = 3

// DefaultBreakerProbe is [Config.BreakerProbe] when it is zero.
const DefaultBreakerProbe = time.Second

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
	c = c.withDefaults()
	switch {
	case c.Client == nil:
		return errors.New("redis: Config.Client is required")
	case typednil.Is(c.Client):
		return fmt.Errorf("redis: Config.Client holds a nil %T: pass a client made by goredis.NewClient or its kin", c.Client)
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
