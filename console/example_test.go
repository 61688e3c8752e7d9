package console_test

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/oncemill/oncemill/console"
	"github.com/oncemill/oncemill/sqlschema"
)

// The console mounted under /ops/ of a service's mux, next to its own
// routes. Operators log in at /ops/login with the token, or scripts send
// it as a Bearer header. The example needs PostgreSQL, so it is compiled,
// not run.
func Example() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		panic(err)
	}
	defer pool.Close()

	ops, err := console.New(console.Config{
		Pool:   pool,
		Schema: sqlschema.Config{}, // oncemill.inbox, oncemill.dlq, oncemill.outbox
		Token:  os.Getenv("ONCEMILL_CONSOLE_TOKEN"),
		// No Publisher: a replay goes to the entry's own consumer, which
		// runs a dlq.ReplaySubscriber.
	})
	if err != nil {
		panic(err)
	}
	mux := http.NewServeMux()
	mux.Handle("/ops/", http.StripPrefix("/ops", ops))
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusNoContent) })

	srv := &http.Server{Addr: "127.0.0.1:8080", Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	if err := srv.ListenAndServe(); err != nil {
		panic(err)
	}
}

// Behind the caller's own authentication (here a stand-in that checks a
// header a single-sign-on proxy sets), the console needs no token of its
// own, and shows without the buttons that change entries.
func ExampleConfig_disableAuth() {
	pool, err := pgxpool.New(context.Background(), os.Getenv("DATABASE_URL"))
	if err != nil {
		panic(err)
	}
	defer pool.Close()
	ops, err := console.New(console.Config{Pool: pool, DisableAuth: true, ReadOnly: true})
	if err != nil {
		panic(err)
	}
	sso := func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.Header.Get("X-Auth-Request-User") == "" {
				http.Error(w, "log in first", http.StatusUnauthorized)
				return
			}
			next.ServeHTTP(w, r)
		})
	}
	http.Handle("/ops/", sso(http.StripPrefix("/ops", ops)))
}

// Errors that differ only in ids, numbers, quoted names or UUIDs fall in
// one group.
func ExampleNormalizeError() {
	fmt.Println(console.NormalizeError("order 123 not found"))
	fmt.Println(console.NormalizeError(`charge "A-42": card declined after 3 attempts`))
	fmt.Println(console.NormalizeError("lock 0c8f9a4e-51f2-4b8e-9a0d-3c7e5d2b1a90 held by 0xc000123abc"))
	// Output:
	// order <n> not found
	// charge "<s>": card declined after <n> attempts
	// lock <uuid> held by <hex>
}
