package prom_test

import (
	"context"
	"strconv"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/oncemill/oncemill/dedup/memory"
	"github.com/oncemill/oncemill/delivery"
	"github.com/oncemill/oncemill/middleware"
	"github.com/oncemill/oncemill/observe"
	"github.com/oncemill/oncemill/observe/prom"
)

// BenchmarkInboxHooks is the inbox's own cost per new key, on the
// in-memory store (no network, so that the hooks' share is not hidden by
// round trips), without hooks and with the Prometheus hooks:
//
//	go test -run '^$' -bench InboxHooks -benchmem ./observe/prom/
func BenchmarkInboxHooks(b *testing.B) {
	for _, tc := range []struct {
		name  string
		hooks func(b *testing.B) []observe.Hook
	}{
		{"none", func(*testing.B) []observe.Hook { return nil }},
		{"prom", func(b *testing.B) []observe.Hook {
			m, err := prom.New(prom.Config{Registerer: prometheus.NewRegistry()})
			if err != nil {
				b.Fatal(err)
			}
			return []observe.Hook{m}
		}},
	} {
		b.Run(tc.name, func(b *testing.B) {
			inbox, err := middleware.NewInbox(middleware.InboxConfig{LeaseStore: memory.New(), Consumer: "bench", Hooks: tc.hooks(b)})
			if err != nil {
				b.Fatal(err)
			}
			h := inbox.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, nil })
			msgs := make([]*message.Message, b.N)
			for i := range msgs {
				m := message.NewMessage(strconv.Itoa(i), nil)
				m.Metadata.Set(delivery.IdempotencyKey, "k"+strconv.Itoa(i))
				m.Metadata.Set(delivery.Topic, "payments")
				m.SetContext(context.Background())
				msgs[i] = m
			}
			b.ReportAllocs()
			b.ResetTimer()
			for _, m := range msgs {
				if _, err := h(m); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
