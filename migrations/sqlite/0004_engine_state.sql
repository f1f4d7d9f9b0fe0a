-- A job's engine state (broker/src/engine/job_engine.rs, JSON): what a restarted broker needs
-- to continue deciding for the job where it was. Identical in both backends.
ALTER TABLE jobs ADD COLUMN engine_state TEXT;
