package reconcile_test

import (
	"context"
	"fmt"
	"log"
	"os"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/oncemill/oncemill/reconcile"
	"github.com/oncemill/oncemill/sqlschema"
)

// A nightly job: the relay keeps its ledger in the shop's database, the
// billing consumer its inbox in its own; the job fails when an event of
// orders.created did not reach billing.
func ExampleCheck() {
	ctx := context.Background()
	shop, err := pgxpool.New(ctx, os.Getenv("SHOP_DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer shop.Close()
	billing, err := pgxpool.New(ctx, os.Getenv("BILLING_DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer billing.Close()

	rep, err := reconcile.Check(ctx, reconcile.Config{
		Ledger:   reconcile.Tables{Pool: shop},
		Inbox:    reconcile.Tables{Pool: billing, Schema: sqlschema.Config{Schema: "billing"}},
		Consumer: "charge",
		Topics:   []string{"orders.created"},
	})
	if err != nil {
		log.Fatal(err) // the check could not run: not a loss
	}
	for _, e := range rep.Missing {
		fmt.Println(e.UUID, e.Topic, e.Key, e.PublishedAt, e.Inbox)
	}
	if !rep.OK() {
		log.Fatalf("%d of %d events missing", rep.MissingEvents(), rep.Checked)
	}
}
