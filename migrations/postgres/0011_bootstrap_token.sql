-- The one-time token an instance's user data carries (its SHA-256, as for agent tokens), and
-- when it was exchanged for the agent token: user data stays readable for the instance's life
-- (ec2:DescribeInstanceAttribute), so what it carries must be dead once the agent has started.
-- Identical in both backends.
ALTER TABLE instances ADD COLUMN bootstrap_hash TEXT;
ALTER TABLE instances ADD COLUMN bootstrap_used_ms BIGINT;
CREATE INDEX instances_by_bootstrap ON instances (bootstrap_hash);
