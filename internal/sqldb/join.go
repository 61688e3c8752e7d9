package sqldb

import "context"

type joinKey struct{}

// Join returns ctx carrying tx, a transaction that the writers which look
// for one in a message's context join when they write on the same
// database, as they join an inbox's transaction (internal/inboxtx): the
// dead-letter publisher, dlq.Publisher. An operator's cancel of a parked
// message (package retry) moves it to the dead-letter table that way,
// the dead letter and the delete of the parked row in one transaction.
func Join(ctx context.Context, tx Executor) context.Context {
	return context.WithValue(ctx, joinKey{}, tx)
}

// Joined returns the transaction [Join] put in ctx, or nil.
func Joined(ctx context.Context) Executor {
	tx, _ := ctx.Value(joinKey{}).(Executor)
	return tx
}
