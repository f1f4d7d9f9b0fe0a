-- The newest output tail (at most 256 KiB) each instance of a command job sent, kept in the
-- database rather than on the disk of the broker that received it, so that every broker shows
-- every instance's output (`proteus logs`) and a takeover loses none. Identical in both
-- backends.
CREATE TABLE program_outputs (
    job_id BIGINT NOT NULL REFERENCES jobs (id),
    instance_id TEXT NOT NULL,
    output TEXT NOT NULL,
    PRIMARY KEY (job_id, instance_id)
);
