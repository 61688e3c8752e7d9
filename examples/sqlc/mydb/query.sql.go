// Written in the shape sqlc generates from query.sql.

package mydb

import (
	"context"
)

const createAccount = `-- name: CreateAccount :exec
INSERT INTO sqlc_accounts (run, balance) VALUES (?, 0)
`

func (q *Queries) CreateAccount(ctx context.Context, run string) error {
	_, err := q.db.ExecContext(ctx, createAccount, run)
	return err
}

const createCharge = `-- name: CreateCharge :exec
INSERT INTO sqlc_charges (run, order_id, amount) VALUES (?, ?, ?)
`

type CreateChargeParams struct {
	Run     string
	OrderID string
	Amount  int64
}

func (q *Queries) CreateCharge(ctx context.Context, arg CreateChargeParams) error {
	_, err := q.db.ExecContext(ctx, createCharge, arg.Run, arg.OrderID, arg.Amount)
	return err
}

const addToBalance = `-- name: AddToBalance :execrows
UPDATE sqlc_accounts SET balance = balance + ? WHERE run = ?
`

type AddToBalanceParams struct {
	Amount int64
	Run    string
}

func (q *Queries) AddToBalance(ctx context.Context, arg AddToBalanceParams) (int64, error) {
	result, err := q.db.ExecContext(ctx, addToBalance, arg.Amount, arg.Run)
	if err != nil {
		return 0, err
	}
	return result.RowsAffected()
}

const countCharges = `-- name: CountCharges :one
SELECT COUNT(*) AS charges, COUNT(DISTINCT order_id) AS orders FROM sqlc_charges WHERE run = ?
`

type CountChargesRow struct {
	Charges int64
	Orders  int64
}

func (q *Queries) CountCharges(ctx context.Context, run string) (CountChargesRow, error) {
	row := q.db.QueryRowContext(ctx, countCharges, run)
	var i CountChargesRow
	err := row.Scan(&i.Charges, &i.Orders)
	return i, err
}

const getBalance = `-- name: GetBalance :one
SELECT balance FROM sqlc_accounts WHERE run = ?
`

func (q *Queries) GetBalance(ctx context.Context, run string) (int64, error) {
	row := q.db.QueryRowContext(ctx, getBalance, run)
	var balance int64
	err := row.Scan(&balance)
	return balance, err
}
