-- A graceful stop (docs/command-jobs.md): the broker told the instance's agent to stop and ends
-- the instance once the agent has left, or at this time (market epoch milliseconds) at the
-- latest. NULL: no stop asked. Identical in both backends.
ALTER TABLE instances ADD COLUMN stop_by_ms BIGINT;
