// Written in the shape sqlc generates from schema.sql.

package pgdb

type SqlcAccount struct {
	Run     string
	Balance int64
}

type SqlcCharge struct {
	ID      int64
	Run     string
	OrderID string
	Amount  int64
}
