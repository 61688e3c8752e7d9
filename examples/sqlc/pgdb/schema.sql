CREATE TABLE IF NOT EXISTS sqlc_accounts (
    run     text   PRIMARY KEY,
    balance bigint NOT NULL
);

CREATE TABLE IF NOT EXISTS sqlc_charges (
    id       bigserial PRIMARY KEY,
    run      text      NOT NULL,
    order_id text      NOT NULL,
    amount   bigint    NOT NULL
);
