//! Command jobs' program output (migration 0010): the newest tail each instance sent, one row
//! per instance, in the database that every broker shares, so that `proteus logs` through any
//! broker shows every instance's output, and a job's output survives the broker that received
//! it.

use super::leases::token_of;
use super::{Context, Lease, Store, StoreError, with_db};
use proteus_wire::JobId;

impl Store {
    /// Replaces `instance`'s output tail, under the job's lease (an agent's tail reaches the
    /// job's owner; fenced as the owner's other writes are).
    pub async fn put_output(
        &self,
        lease: Option<&Lease>,
        job: JobId,
        instance: &str,
        text: &str,
    ) -> Result<(), StoreError> {
        let n = with_db!(self, |pool| {
            sqlx::query(
                "INSERT INTO program_outputs (job_id, instance_id, output) \
                 SELECT $1, $2, $3 WHERE EXISTS \
                     (SELECT 1 FROM jobs WHERE id = $1 AND ($4 IS NULL OR lease_token = $4)) \
                 ON CONFLICT (job_id, instance_id) DO UPDATE SET output = excluded.output",
            )
            .bind(job.0)
            .bind(instance)
            .bind(text)
            .bind(token_of(lease))
            .execute(pool)
            .await
            .context("recording a program's output")?
            .rows_affected()
        });
        self.fenced(lease, n).await?;
        Ok(())
    }

    /// Every instance's output tail of `job`, by instance id.
    pub async fn outputs_of_job(&self, job: JobId) -> Result<Vec<(String, String)>, StoreError> {
        let rows: Vec<(String, String)> = with_db!(self, |pool| {
            sqlx::query_as(
                "SELECT instance_id, output FROM program_outputs WHERE job_id = $1 \
                 ORDER BY instance_id",
            )
            .bind(job.0)
            .fetch_all(pool)
            .await
            .context("reading a job's program output")?
        });
        Ok(rows)
    }
}
