-- The agent token a launch's user data carries, kept from the launch intent until the cloud's
-- answer is recorded (then NULL): a retried launch, and a relaunch by the broker that took the
-- job over, send the same ClientToken with the same parameters, as EC2's idempotency requires
-- (docs/operations.md). Identical in both backends.
ALTER TABLE instances ADD COLUMN launch_token TEXT;
