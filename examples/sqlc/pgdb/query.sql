-- name: CreateAccount :exec
INSERT INTO sqlc_accounts (run, balance) VALUES ($1, 0);

-- name: CreateCharge :exec
INSERT INTO sqlc_charges (run, order_id, amount) VALUES ($1, $2, $3);

-- name: AddToBalance :execrows
UPDATE sqlc_accounts SET balance = balance + sqlc.arg(amount) WHERE run = sqlc.arg(run);

-- name: CountCharges :one
SELECT COUNT(*) AS charges, COUNT(DISTINCT order_id) AS orders FROM sqlc_charges WHERE run = $1;

-- name: GetBalance :one
SELECT balance FROM sqlc_accounts WHERE run = $1;
