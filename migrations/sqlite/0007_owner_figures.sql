-- What only a job's owner computes (its stage, what holds launches back, the ETA and the
-- deadline's slack), saved by the owner as it changes (JSON), so that every broker on the
-- database shows a job the same way. Identical in both backends.
ALTER TABLE jobs ADD COLUMN owner_figures TEXT;
