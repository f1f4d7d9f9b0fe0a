-- What every job of every broker saw of a spot pool: a spot launch granted or refused for
-- capacity, an interruption notice, a spot instance its job let go. Append-only: each broker
-- folds the rows, in id order, into its pool book (market_model/pool_book.rs), so brokers
-- sharing this database, and a broker after a restart, believe and learn the same.
CREATE TABLE pool_observations (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    market TEXT NOT NULL,
    at_ms BIGINT NOT NULL,
    seen TEXT NOT NULL CHECK (seen IN ('granted', 'refused', 'interrupted', 'released'))
);
