-- Work accounting (broker/src/engine/work.rs): when each instance started working for its job,
-- and the work each job has received and is now expected to need. Identical in both backends.
ALTER TABLE instances ADD COLUMN ready_ms BIGINT;
ALTER TABLE jobs ADD COLUMN work_done_units DOUBLE PRECISION NOT NULL DEFAULT 0;
ALTER TABLE jobs ADD COLUMN expected_work_units DOUBLE PRECISION;
