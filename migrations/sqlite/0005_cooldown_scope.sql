-- What a cool-down covers: 1 when only the market's spot offer is skipped (a spot launch was
-- refused; on-demand capacity is separate), 0 when the whole market is (an on-demand launch was
-- refused, or a cool-down recorded before this column). Identical in both backends.
ALTER TABLE market_cooldowns ADD COLUMN spot_only BIGINT NOT NULL DEFAULT 0;
