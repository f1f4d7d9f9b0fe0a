-- Several brokers on one database (issue 24). Identical in both backends. Lease times are wall
-- epoch milliseconds (leases are between broker processes, not in market time).
--
-- Each running broker has a row, refreshed every few seconds; a broker whose heartbeat is older
-- than its lease is dead.
CREATE TABLE brokers (
    id TEXT PRIMARY KEY,
    -- The URL agents and peers reach it at.
    url TEXT NOT NULL,
    pid BIGINT NOT NULL,
    started_ms BIGINT NOT NULL,
    heartbeat_ms BIGINT NOT NULL
);

-- Each unfinished job is owned through a lease: only the owner schedules it, calls the cloud
-- for it and controls its agents. The token only grows (every takeover adds one) and every
-- write the owner makes for the job carries it, so a broker that lost the lease cannot write.
ALTER TABLE jobs ADD COLUMN lease_owner TEXT;
ALTER TABLE jobs ADD COLUMN lease_token BIGINT NOT NULL DEFAULT 0;
ALTER TABLE jobs ADD COLUMN lease_expires_ms BIGINT NOT NULL DEFAULT 0;
CREATE INDEX jobs_by_lease_owner ON jobs (lease_owner);

-- The process id of a locally started agent (sim and LocalStack), so that whichever broker owns
-- the job can stop it when its instance ends.
ALTER TABLE instances ADD COLUMN agent_pid BIGINT;
