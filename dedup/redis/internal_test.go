package redis

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"strings"
	"syscall"
	"testing"

	goredis "github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/dedup"
)

// replyError is an error reply as go-redis reports one.
type replyError string

func (e replyError) Error() string { return string(e) }
func (replyError) RedisError()     {}

func TestUnavailableClassification(t *testing.T) {
	t.Parallel()
	down := map[string]error{
		"refused":        &net.OpError{Op: "dial", Net: "tcp", Err: syscall.ECONNREFUSED},
		"reset":          &net.OpError{Op: "read", Net: "tcp", Err: syscall.ECONNRESET},
		"eof":            io.EOF,
		"unexpected eof": fmt.Errorf("read: %w", io.ErrUnexpectedEOF),
		"pool timeout":   goredis.ErrPoolTimeout,
		"closed client":  goredis.ErrClosed,
		"dial deadline":  context.DeadlineExceeded,
		"loading":        replyError("LOADING Redis is loading the dataset in memory"),
		"readonly":       replyError("READONLY You can't write against a read only replica."),
		"readonly in a Redis 6 script": replyError("ERR Error running script (call to f_x): @user_script:1: " +
			"-READONLY You can't write against a read only replica."),
		"oom":         replyError("OOM command not allowed when used memory > 'maxmemory'."),
		"masterdown":  replyError("MASTERDOWN Link with MASTER is down"),
		"clusterdown": replyError("CLUSTERDOWN The cluster is down"),
		"tryagain":    replyError("TRYAGAIN Multiple keys request during rehashing of slot"),
		"busy":        replyError("BUSY Redis is busy running a script."),
		"misconf":     replyError("MISCONF Redis is configured to save RDB snapshots, but it's currently unable to persist to disk."),
		"max clients": replyError("ERR max number of clients reached"),
	}
	for name, err := range down {
		require.True(t, unavailable(err), name)
		require.True(t, unavailable(fmt.Errorf("hook: %w", err)), name+", wrapped")
	}
	real := map[string]error{
		"wrongtype":    replyError("WRONGTYPE Operation against a key holding the wrong kind of value"),
		"script error": replyError("ERR user_script:3: Script attempted to access nonexistent global variable 'x'"),
		"noauth":       replyError("NOAUTH Authentication required."),
		"noperm":       replyError("NOPERM this user has no permissions to run the 'evalsha' command"),
		"noscript":     goredis.ErrNoScript,
	}
	for name, err := range real {
		require.False(t, unavailable(err), name)
	}
}

func TestWrapKeepsCancellationApart(t *testing.T) {
	t.Parallel()
	s := &Store{}
	err := s.wrap(context.Background(), "lease claim", io.EOF)
	require.ErrorIs(t, err, ErrUnavailable)
	require.ErrorIs(t, err, io.EOF)
	require.Equal(t, "redis: lease claim: redis: server unavailable: EOF", err.Error())

	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	err = s.wrap(ctx, "lease claim", context.Canceled)
	require.ErrorIs(t, err, context.Canceled)
	require.False(t, errors.Is(err, ErrUnavailable), "the caller's cancellation is not unavailability")
}

func TestRecordKeyLayout(t *testing.T) {
	t.Parallel()
	s := &Store{prefix: "app:"}
	require.Equal(t, "app:{billing}:order-1", s.recordKey(dedup.Key{Consumer: "billing", Key: "order-1"}))
	require.Equal(t, "app:{a%7D%7B%25%2A%3F%5B%5D%5C}:k}{*", s.recordKey(dedup.Key{Consumer: `a}{%*?[]\`, Key: "k}{*"}))
	require.Equal(t, `app\*x\?\[y\]\\:`, globEscape(`app*x?[y]\:`))
}

// TestRecordKeysAreInjective draws pairs from a small alphabet full of the
// characters that matter, and checks that distinct pairs never share a
// Redis key, that the hash tag is exactly the escaped consumer, and that the
// key reads back from after the consumer's prefix.
func TestRecordKeysAreInjective(t *testing.T) {
	t.Parallel()
	s := &Store{prefix: "p:"}
	alphabet := []string{"a", "}", "{", ":", "%", "7D", "*", "?", "[", "]", `\`, "é", "😀"}
	draw := func(r *rand.Rand) string {
		var b strings.Builder
		for n := r.IntN(5); n > 0; n-- {
			b.WriteString(alphabet[r.IntN(len(alphabet))])
		}
		return b.String()
	}
	r := rand.New(rand.NewPCG(1, 2))
	seen := map[string]dedup.Key{}
	for i := 0; i < 50000; i++ {
		k := dedup.Key{Consumer: draw(r), Key: draw(r)}
		rk := s.recordKey(k)
		if prev, ok := seen[rk]; ok {
			require.Equal(t, prev, k, "two pairs share the Redis key %q", rk)
		}
		seen[rk] = k

		open := strings.IndexByte(rk, '{')
		end := open + strings.IndexByte(rk[open:], '}')
		require.Equal(t, escapeConsumer(k.Consumer), rk[open+1:end], "hash tag of %q", rk)
		require.NotContains(t, rk[open+1:end], "{")
		require.False(t, strings.ContainsAny(rk[open+1:end], `*?[]\`), "the hash tag needs no glob escaping")

		prefix := s.consumerPrefix(k.Consumer)
		require.True(t, strings.HasPrefix(rk, prefix))
		require.Equal(t, k.Key, strings.TrimPrefix(rk, prefix))
	}
}
