-- Price history. Kept column-for-column identical to ../postgres/0001_prices.sql; only the
-- surrogate-key syntax differs (a test compares the two schemas).

CREATE TABLE markets (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    region TEXT NOT NULL,
    availability_zone TEXT NOT NULL,
    instance_type TEXT NOT NULL,
    product TEXT NOT NULL,
    UNIQUE (availability_zone, instance_type, product)
);

CREATE TABLE instance_types (
    region TEXT NOT NULL,
    instance_type TEXT NOT NULL,
    vcpus BIGINT,
    memory_gib DOUBLE PRECISION,
    on_demand_usd_per_hour DOUBLE PRECISION NOT NULL,
    PRIMARY KEY (region, instance_type)
);

-- No foreign key on market_id (see ../postgres/0001_prices.sql).
CREATE TABLE spot_prices (
    market_id BIGINT NOT NULL,
    ts_ms BIGINT NOT NULL,
    usd_per_hour DOUBLE PRECISION NOT NULL,
    PRIMARY KEY (market_id, ts_ms)
) WITHOUT ROWID;
