package postgres_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/oncemill/oncemill/dedup"
)

// TestFailureTextPostgreSQLRefuses: a handler error that quotes a binary
// payload (a NUL byte, invalid UTF-8) is still recorded, in every place a
// failure is written, with U+FFFD in place of what PostgreSQL cannot store.
// Before, the failure's own record failed and the attempt went uncounted.
func TestFailureTextPostgreSQLRefuses(t *testing.T) {
	t.Parallel()
	b := setup(t, 4)
	ctx := context.Background()
	bad := "decode: unexpected byte \x00 in \xff\xfe payload"
	want := "decode: unexpected byte \uFFFD in \uFFFD payload"
	at := time.Now()

	failed := dedup.Key{Consumer: "billing", Key: "order-nul"}
	require.NoError(t, b.store.InboxFail(ctx, failed, dedup.Failure{Err: bad, At: at}, time.Hour))
	r, ok := b.row(t, failed)
	require.True(t, ok)
	require.Equal(t, "failed", r.status)
	require.Equal(t, want, *r.lastErr)

	buried := dedup.Key{Consumer: "billing", Key: "order-bury"}
	tx, err := b.store.InboxBegin(ctx)
	require.NoError(t, err)
	_, err = tx.InboxClaim(ctx, buried, time.Hour)
	require.NoError(t, err)
	require.NoError(t, tx.InboxBury(ctx, buried, dedup.Failure{Err: bad, At: at}))
	require.NoError(t, tx.Commit(ctx))
	r, _ = b.row(t, buried)
	require.Equal(t, "dead", r.status)
	require.Equal(t, want, *r.lastErr)

	for _, release := range []bool{true, false} {
		key := dedup.Key{Consumer: "mailer", Key: "mail-" + map[bool]string{true: "release", false: "bury"}[release]}
		c, err := b.store.LeaseClaim(ctx, key, time.Minute, time.Hour)
		require.NoError(t, err)
		if release {
			require.NoError(t, b.store.LeaseRelease(ctx, key, c.Token, dedup.Failure{Err: bad, At: at}))
		} else {
			require.NoError(t, b.store.LeaseBury(ctx, key, c.Token, dedup.Failure{Err: bad, At: at}))
		}
		r, _ := b.row(t, key)
		require.Equal(t, want, *r.lastErr, key.Key)
	}
}
