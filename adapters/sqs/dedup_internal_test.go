package sqs

import (
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/assert"

	"github.com/oncemill/oncemill/delivery"
)

// TestDedupID checks the FIFO deduplication ID: the same for two publishes
// of one message, different for a replay and for each dead-lettering, and
// always one SQS accepts.
func TestDedupID(t *testing.T) {
	t.Parallel()
	msg := func(uuid string, md map[string]string) *message.Message {
		m := message.NewMessage(uuid, []byte("p"))
		for k, v := range md {
			m.Metadata.Set(k, v)
		}
		return m
	}
	key := map[string]string{delivery.IdempotencyKey: "pay-42"}
	with := func(extra map[string]string) map[string]string {
		md := map[string]string{delivery.IdempotencyKey: "pay-42"}
		for k, v := range extra {
			md[k] = v
		}
		return md
	}

	// Neither a replay nor a dead letter: the key, else the UUID, as before.
	assert.Equal(t, "pay-42", dedupID(msg("u1", key)))
	assert.Equal(t, dedupID(msg("u1", key)), dedupID(msg("u2", key)), "the key, not the UUID, names the publish")
	assert.Equal(t, "u1", dedupID(msg("u1", nil)))

	replay7 := dedupID(msg("u1", with(map[string]string{delivery.Replay: "7"})))
	replay8 := dedupID(msg("u1", with(map[string]string{delivery.Replay: "8"})))
	dead1 := with(map[string]string{delivery.DeadConsumer: "charge", delivery.DeadLastFailedAt: "2026-03-01T10:04:00.5Z", delivery.DeadAttempts: "4"})
	dead2 := with(map[string]string{delivery.DeadConsumer: "charge", delivery.DeadLastFailedAt: "2026-03-01T10:09:00.25Z", delivery.DeadAttempts: "4"})
	deadOther := with(map[string]string{delivery.DeadConsumer: "ship", delivery.DeadLastFailedAt: "2026-03-01T10:04:00.5Z", delivery.DeadAttempts: "4"})
	ids := map[string]string{
		"original":         dedupID(msg("u1", key)),
		"replay 7":         replay7,
		"replay 8":         replay8,
		"dead-lettered":    dedupID(msg("u1", dead1)),
		"dead-lettered 2":  dedupID(msg("u1", dead2)),
		"dead other":       dedupID(msg("u1", deadOther)),
		"replay then dead": dedupID(msg("u1", with(map[string]string{delivery.Replay: "7", delivery.DeadConsumer: "charge", delivery.DeadLastFailedAt: "2026-03-01T10:04:00.5Z"}))),
	}
	seen := map[string]string{}
	for name, id := range ids {
		assert.NotContains(t, seen, id, "%s has the ID of %s", name, seen[id])
		seen[id] = name
		assert.LessOrEqual(t, len(id), maxFIFOIDLength, name)
		assert.True(t, validFIFOID(id), "%s: %q", name, id)
	}
	assert.True(t, strings.HasPrefix(replay7, "pay-42:"), "the key stays readable: %s", replay7)
	assert.Len(t, replay7, len("pay-42:")+64)

	// A retry of one publish carries the same metadata: the same ID.
	assert.Equal(t, replay7, dedupID(msg("u9", with(map[string]string{delivery.Replay: "7"}))))
	assert.Equal(t, ids["dead-lettered"], dedupID(msg("u1", dead1)))

	// Long keys are cut to fit, keys SQS would reject are left out; the
	// hash covers the whole key either way.
	long := strings.Repeat("k", 200)
	a := dedupID(msg("u", map[string]string{delivery.IdempotencyKey: long + "a", delivery.Replay: "1"}))
	b := dedupID(msg("u", map[string]string{delivery.IdempotencyKey: long + "b", delivery.Replay: "1"}))
	assert.Len(t, a, maxFIFOIDLength)
	assert.NotEqual(t, a, b)
	spaced := dedupID(msg("u", map[string]string{delivery.IdempotencyKey: "has a space", delivery.Replay: "1"}))
	assert.Len(t, spaced, 64)
	assert.True(t, validFIFOID(spaced))
}
