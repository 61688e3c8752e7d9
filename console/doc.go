// Package console is an operator's console for oncemill, served as an
// http.Handler: what the inbox, the dead-letter queue and the outbox hold,
// and the replays and purges of package dlq, from a browser.
//
//	c, err := console.New(console.Config{Pool: pool, Token: os.Getenv("CONSOLE_TOKEN")})
//	mux.Handle("/ops/", http.StripPrefix("/ops", c))
//
// Through database/sql, the tables are read on PostgreSQL, MySQL or
// MariaDB, or SQLite: console.Config{DB: db, Dialect: sqlschema.SQLite, …}.
//
// # Pages
//
//   - / (Overview): per consumer, from the inbox table, the keys applied
//     in the last hour and day, in flight, failing now and dead, and the
//     copies of dead keys acked; the dead letters per consumer and topic
//     (what [dlq.Store.Counts] counts) and their largest error groups; the outbox's
//     pending and waiting rows, the age of the oldest, and the transaction
//     that holds the relay back ([forwarder.OutboxLag]). Duplicates are not
//     there: the inbox writes nothing for a duplicate, and the Prometheus
//     metric oncemill_inbox_messages_total{outcome="duplicate"} counts them.
//     The inbox's dead keys and the dead letters count different things
//     (dead inbox rows; entries of the dead-letter table, which also hold
//     messages dead-lettered without an inbox and outlive expired inbox
//     rows); where they differ for a consumer, the page says so and why.
//     With Config.Reconcile, the consumers' reconciliation with the
//     relay's ledger ([reconcile.Check]): events checked, lost, stuck and
//     unexplained keys, and the oldest missing events.
//   - /dlq (Dead letters): a filter form (topic, consumer, error text,
//     since, until: RFC 3339, a UTC time as a datetime-local input sends
//     it, or a duration ago such as 90m, 2h or 7d), the filtered entries
//     grouped by error ([NormalizeError]; a group filters the list), and
//     the entries, newest first, a page at a time.
//   - /dlq/{id} (an entry): its payload (pretty JSON, text, or a hex dump;
//     at most Config.MaxPayload bytes are read), metadata, attempts with
//     who counted them ([dlq.Entry.AttemptsCounted]), failures, the
//     broker's place of the original as far as it is known
//     ([dlq.Entry.Place]) and replay state.
//   - /inbox?consumer=&key= (Inbox lookup): one key's record, its stored
//     result included.
//
// Replays and purges take one entry, the ticked entries, a group or
// everything the filter matches, in two steps: the first POST resolves
// the selection to the ids of the entries it holds now and shows them,
// counted by destination ("Replay 12 entries to consumer charge (topic
// orders)"); the second acts on exactly those ids, so that an entry that
// arrived in between is untouched, and at most 10000 at a time. A replay
// goes to the entry's consumer ([dlq.Store.RequestReplay]: the consumer's
// [dlq.ReplaySubscriber] delivers it and deletes it once handled) or,
// with Config.Publisher, to the original topic ([dlq.Store.Replay]: every
// consumer group receives it, and an entry is deleted only once published).
// The guarantees are dlq's.
//
// # Authentication
//
// Every request but /login and /static/ carries Config.Token, as
// "Authorization: Bearer <token>" or as the session cookie that the login
// form sets; without it the answer is 401 (with the login form, for a
// browser). Tokens are compared in constant time. The cookie is not the
// token: it holds its time of issue and an HMAC-SHA256 of it under a key
// derived from the token, so that a leaked cookie does not reveal the
// token and lasts at most 12 hours, every replica with the token accepts
// it, and changing the token revokes every cookie. It is HttpOnly,
// SameSite=Strict and, over TLS, Secure; its path is the console's root,
// whatever the prefix.
//
// With Config.DisableAuth the console serves every request, for mounting
// behind the caller's own authentication (a proxy's SSO, a middleware
// around the handler); the CSRF rules below still apply.
//
// # CSRF and other defences
//
// Every POST but the login carries a CSRF token, in the form's csrf field
// (or an X-CSRF-Token header): an HMAC of the session — the cookie's value,
// the bearer token, or with DisableAuth a random cookie of its own — under
// a random key of the Console. Pages carry it in their forms, and every
// authenticated response in its X-CSRF-Token header, for scripts. A
// Console restarted has a new key: a form rendered before is refused
// (reload it). Every POST, the login's included, is refused when
// Sec-Fetch-Site, Origin or Referer says that it comes from another
// origin. Responses carry Content-Security-Policy default-src 'self' (the
// console's little JavaScript is a static file), X-Frame-Options DENY,
// X-Content-Type-Options nosniff and Referrer-Policy same-origin; pages are
// html/template, so everything from the tables is escaped. The SQL takes
// every value as a parameter; the only names in it are sqlschema's.
//
// Config.ReadOnly refuses every replay and purge with 403 and hides their
// buttons.
//
// # Mounting
//
// Links and redirects are relative, so the console works under any
// prefix, behind http.StripPrefix or a proxy that strips it. Templates and
// assets are embedded: it needs no network, no CDN and no build step.
package console
