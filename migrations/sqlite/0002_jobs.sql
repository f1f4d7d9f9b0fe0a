-- Jobs, the instances bought for them, agents, events and the cost ledger. Kept column-for-column
-- identical to ../postgres/0002_jobs.sql. Times are epoch milliseconds of *market* time (wall time
-- on a real cloud; the accelerated clock of the simulated cloud). Booleans are BIGINT 0/1.

CREATE TABLE jobs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    name TEXT NOT NULL,
    -- The submitted job spec (JSON), exactly as accepted.
    spec TEXT NOT NULL,
    policy TEXT NOT NULL,
    billing TEXT NOT NULL,
    state TEXT NOT NULL,
    state_reason TEXT,
    budget_usd DOUBLE PRECISION,
    deadline_ms BIGINT,
    -- Fraction of the job's work done, 0..1, as reported by its agents.
    progress DOUBLE PRECISION NOT NULL DEFAULT 0,
    -- Latest reported metric (JSON), e.g. {"kind":"accuracy","value":0.92}.
    metric TEXT,
    -- The agents' cluster layout and control state (JSON), so a restarted broker can resume.
    control_state TEXT,
    created_ms BIGINT NOT NULL,
    started_ms BIGINT,
    finished_ms BIGINT
);

-- One row per instance the broker decided to buy, written *before* the cloud is asked, so that
-- after a crash the broker can find (by tag) or relaunch exactly what it intended, never twice.
CREATE TABLE instances (
    id TEXT PRIMARY KEY,
    job_id BIGINT NOT NULL REFERENCES jobs (id),
    cloud_id TEXT UNIQUE,
    availability_zone TEXT NOT NULL,
    instance_type TEXT NOT NULL,
    product TEXT NOT NULL,
    tier TEXT NOT NULL,
    bid_usd DOUBLE PRECISION,
    state TEXT NOT NULL,
    -- Hash of the per-instance agent token; the token itself is never stored.
    token_hash TEXT NOT NULL,
    requested_ms BIGINT NOT NULL,
    launched_ms BIGINT,
    warned_ms BIGINT,
    ended_ms BIGINT,
    end_reason TEXT,
    -- 1 if the provider ended it (eviction): under hourly-2015 billing its partial hour is free.
    ended_by_provider BIGINT NOT NULL DEFAULT 0,
    launch_error TEXT,
    -- Where a locally launched agent's instance-metadata endpoint listens (sim and LocalStack).
    metadata_addr TEXT
);
CREATE INDEX instances_by_job ON instances (job_id, state);
CREATE INDEX instances_by_token ON instances (token_hash);

CREATE TABLE agents (
    instance_id TEXT PRIMARY KEY REFERENCES instances (id),
    job_id BIGINT NOT NULL REFERENCES jobs (id),
    data_addr TEXT NOT NULL,
    vcpus BIGINT NOT NULL,
    registered_ms BIGINT NOT NULL,
    last_heartbeat_ms BIGINT,
    samples_per_sec DOUBLE PRECISION
);

CREATE TABLE events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id BIGINT REFERENCES jobs (id),
    instance_id TEXT,
    ts_ms BIGINT NOT NULL,
    kind TEXT NOT NULL,
    detail TEXT NOT NULL
);
CREATE INDEX events_by_job ON events (job_id, id);

-- Billed segments: an hour (hourly-2015) or a run of seconds (per-second) of one instance.
CREATE TABLE ledger_lines (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id BIGINT NOT NULL REFERENCES jobs (id),
    instance_id TEXT NOT NULL REFERENCES instances (id),
    start_ms BIGINT NOT NULL,
    end_ms BIGINT NOT NULL,
    usd_per_hour DOUBLE PRECISION NOT NULL,
    amount_usd DOUBLE PRECISION NOT NULL,
    free BIGINT NOT NULL DEFAULT 0,
    UNIQUE (instance_id, start_ms)
);
CREATE INDEX ledger_by_job ON ledger_lines (job_id);

-- Markets the cloud refused recently (capacity, quota, price too low): skipped until `until_ms`.
CREATE TABLE market_cooldowns (
    availability_zone TEXT NOT NULL,
    instance_type TEXT NOT NULL,
    until_ms BIGINT NOT NULL,
    reason TEXT NOT NULL,
    PRIMARY KEY (availability_zone, instance_type)
);

-- The user API token's hash (the token itself is shown once, when generated).
CREATE TABLE api_tokens (
    name TEXT PRIMARY KEY,
    token_hash TEXT NOT NULL,
    created_ms BIGINT NOT NULL
);
