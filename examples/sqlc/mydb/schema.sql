CREATE TABLE IF NOT EXISTS sqlc_accounts (
    run     VARCHAR(64) PRIMARY KEY,
    balance BIGINT      NOT NULL
) ENGINE = InnoDB;

CREATE TABLE IF NOT EXISTS sqlc_charges (
    id       BIGINT      AUTO_INCREMENT PRIMARY KEY,
    run      VARCHAR(64) NOT NULL,
    order_id VARCHAR(64) NOT NULL,
    amount   BIGINT      NOT NULL
) ENGINE = InnoDB;
