package dlq

import (
	"context"
	"time"

	"github.com/oncemill/oncemill/internal/sqldb"
)

// Count is how many entries the dead-letter table holds for one consumer
// and original topic.
type Count struct {
	// Consumer is the consumer (handler) that gave up on the entries; ""
	// for entries whose dead letter did not say.
	Consumer string `json:"consumer"`
	// Topic is the topic the entries were consumed from; "" when unknown.
	Topic string `json:"topic"`
	// Entries is the number of entries, at least 1.
	Entries int `json:"entries"`
	// Oldest is when the oldest of them was written (its DeadAt).
	Oldest time.Time `json:"oldest"`
}

// Counts returns the number of entries per consumer and original topic,
// ordered by consumer then topic; pairs without entries are left out, so
// an empty table gives none. It reads the whole table in one aggregate
// query (entries whose replay was requested included, until they are
// replayed), which is what a metrics collector scrapes: bound it with
// ctx.
func (s *Store) Counts(ctx context.Context) ([]Count, error) {
	rows, err := s.t.db.Query(ctx, s.t.q.counts)
	counts, err := sqldb.Collect(rows, err, func(r sqldb.Rows) (c Count, err error) {
		err = r.Scan(&c.Consumer, &c.Topic, &c.Entries, sqldb.Time(&c.Oldest))
		return c, err
	})
	if err != nil {
		return nil, s.t.wrap("count by consumer and topic", err)
	}
	return counts, nil
}
