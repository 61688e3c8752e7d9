package sqlite_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"

	"github.com/oncemill/oncemill/dedup"
	"github.com/oncemill/oncemill/dedup/sqlite"
)

// A handler writes its effect through the transaction in which the inbox
// claimed the key, so that a redelivered message finds the key done and
// the effect is applied once.
func Example() {
	ctx := context.Background()
	dir, err := os.MkdirTemp("", "oncemill-example")
	if err != nil {
		panic(err)
	}
	defer os.RemoveAll(dir)

	store, err := sqlite.Open(ctx, filepath.Join(dir, "app.db"), sqlite.Config{})
	if err != nil {
		panic(err)
	}
	defer store.Close()
	if _, err := store.DB().ExecContext(ctx, `CREATE TABLE orders (id TEXT PRIMARY KEY)`); err != nil {
		panic(err)
	}

	// The handler: it finds the transaction in its context.
	handle := func(ctx context.Context, orderID string) error {
		_, err := sqlite.Tx(ctx).ExecContext(ctx, `INSERT INTO orders (id) VALUES (?)`, orderID)
		return err
	}

	key := dedup.Key{Consumer: "orders", Key: "order-1"}
	for delivery := 1; delivery <= 2; delivery++ {
		tx, err := store.InboxBegin(ctx)
		if err != nil {
			panic(err)
		}
		claim, err := tx.InboxClaim(ctx, key, dedup.DefaultWindow)
		if err != nil {
			panic(err)
		}
		if claim.State == dedup.StateNew {
			if err := handle(tx.WithTx(ctx), key.Key); err != nil {
				_ = tx.Rollback(ctx)
				panic(err)
			}
		}
		if err := tx.Commit(ctx); err != nil {
			panic(err)
		}
		fmt.Printf("delivery %d: %s\n", delivery, claim.State)
	}

	var orders int
	if err := store.DB().QueryRowContext(ctx, `SELECT count(*) FROM orders`).Scan(&orders); err != nil {
		panic(err)
	}
	fmt.Println("orders:", orders)
	// Output:
	// delivery 1: new
	// delivery 2: done
	// orders: 1
}
