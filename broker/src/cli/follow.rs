//! Following a job as it runs: `proteus submit --follow`, `status ID --watch`, `logs ID -f`.
//!
//! A loop polls the job, its new events and (for command jobs) its programs' output, prints
//! what changed, and ends when the job does: exit 0 when it succeeded, 1 otherwise. Ctrl-C
//! stops following and leaves the job running (exit 130, as an interrupted tool).
//!
//! What to print is decided by [`Follower`], a pure state machine fed each poll's answers;
//! the loop around it only fetches and writes.

use super::client::Client;
use crate::service::jobs::JobView;
use anyhow::{Result, bail};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io::Write;
use std::process::ExitCode;
use std::time::Duration;

/// What to show while following.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Show {
    /// A line whenever progress, spend, instances, evictions or the state change.
    pub status: bool,
    /// The job's events (launches, warnings, evictions, ...).
    pub events: bool,
    /// What command jobs' programs print, per instance.
    pub output: bool,
    /// Only this instance's output.
    pub instance: Option<String>,
}

/// How lines are written: for people, or one JSON object per line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lines {
    Text,
    Json,
}

/// One event of the job, as `GET /v1/jobs/{id}/events` gives it.
#[derive(Debug, Clone, Deserialize)]
pub struct Event {
    pub id: i64,
    pub time: String,
    pub instance_id: Option<String>,
    pub kind: String,
    pub detail: String,
}

/// One program's output tail, as `GET /v1/jobs/{id}/logs` gives it.
#[derive(Debug, Clone, Deserialize)]
pub struct Tail {
    pub instance_id: String,
    pub output: String,
}

/// A line to print.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Line {
    Status {
        state: String,
        progress: f64,
        spend_usd: f64,
        instances: BTreeMap<String, u32>,
        leaving: BTreeMap<String, u32>,
        evictions: u32,
    },
    Event {
        time: String,
        kind: String,
        instance_id: Option<String>,
        detail: String,
    },
    Output {
        instance_id: String,
        text: String,
    },
    End {
        state: String,
        reason: Option<String>,
    },
}

impl Line {
    fn text(&self) -> String {
        match self {
            Line::Status {
                state,
                progress,
                spend_usd,
                instances,
                leaving,
                evictions,
            } => {
                let held = if instances.is_empty() {
                    "no instances".to_string()
                } else {
                    instances
                        .iter()
                        .map(|(tier, n)| format!("{n} {tier}"))
                        .collect::<Vec<_>>()
                        .join(", ")
                };
                let leaving = super::client::leaving_text(leaving);
                format!(
                    "[status] {state}: {:.1}% done, spend ${spend_usd:.4}, {held}{leaving}, {evictions} eviction{}",
                    progress * 100.0,
                    if *evictions == 1 { "" } else { "s" }
                )
            }
            Line::Event {
                time,
                kind,
                instance_id,
                detail,
            } => match instance_id {
                Some(i) => format!("[event] {time} {kind} {i}: {detail}"),
                None => format!("[event] {time} {kind}: {detail}"),
            },
            Line::Output { instance_id, text } => text
                .lines()
                .map(|l| format!("[{instance_id}] {l}"))
                .collect::<Vec<_>>()
                .join("\n"),
            Line::End { state, reason } => match reason {
                Some(r) => format!("[end] the job {state}: {r}"),
                None => format!("[end] the job {state}"),
            },
        }
    }
}

/// What has been shown of a job, and so what a new poll adds.
#[derive(Debug, Default)]
pub struct Follower {
    last_status: Option<Line>,
    last_event: i64,
    tails: BTreeMap<String, String>,
    ended: bool,
}

impl Follower {
    /// The id after which events are new.
    pub fn events_after(&self) -> i64 {
        self.last_event
    }

    /// Whether the job has ended (the last line was [`Line::End`]).
    pub fn ended(&self) -> bool {
        self.ended
    }

    /// The lines one poll adds: new events, new output, then the status if it changed, and
    /// the end once the job is over.
    pub fn poll(&mut self, job: &JobView, events: &[Event], tails: &[Tail]) -> Vec<Line> {
        let mut lines = Vec::new();
        for e in events {
            if e.id <= self.last_event {
                continue;
            }
            self.last_event = e.id;
            lines.push(Line::Event {
                time: e.time.clone(),
                kind: e.kind.clone(),
                instance_id: e.instance_id.clone(),
                detail: e.detail.clone(),
            });
        }
        for t in tails {
            let old = self.tails.get(&t.instance_id).map_or("", String::as_str);
            let grown = tail_growth(old, &t.output);
            if !grown.is_empty() {
                lines.push(Line::Output {
                    instance_id: t.instance_id.clone(),
                    text: grown.to_string(),
                });
            }
            self.tails.insert(t.instance_id.clone(), t.output.clone());
        }
        let status = Line::Status {
            state: job.state.clone(),
            progress: (job.progress * 1000.0).round() / 1000.0,
            spend_usd: (job.spend_usd.get() * 10_000.0).round() / 10_000.0,
            instances: job.instances_by_tier.clone(),
            leaving: job.leaving_by_tier.clone(),
            evictions: job.evictions,
        };
        if self.last_status.as_ref() != Some(&status) {
            self.last_status = Some(status.clone());
            lines.push(status);
        }
        if is_over(&job.state) && !self.ended {
            self.ended = true;
            lines.push(Line::End {
                state: job.state.clone(),
                reason: job.state_reason.clone(),
            });
        }
        lines
    }
}

/// Whether a job in `state` (as its view names it) is over.
pub(crate) fn is_over(state: &str) -> bool {
    !matches!(state, "pending" | "running")
}

/// What `new` adds to `old`, two tails of one output: `new` may have lost lines at its front
/// (a tail is bounded) and gained lines at its end. Output that does not continue `old` (a
/// program restarted into an emptied tail) is new as a whole.
pub fn tail_growth<'a>(old: &str, new: &'a str) -> &'a str {
    if let Some(rest) = new.strip_prefix(old) {
        return rest;
    }
    let Some(first) = new.split_inclusive('\n').next() else {
        return new;
    };
    // The longest end of `old`, from a line start, that `new` starts with.
    let mut at = 0;
    for line in old.split_inclusive('\n') {
        if line == first && new.starts_with(&old[at..]) {
            return &new[old.len() - at..];
        }
        at += line.len();
    }
    new
}

/// Follows job `id` until it ends or Ctrl-C, polling every `every`.
pub async fn follow(
    client: &Client,
    id: i64,
    show: Show,
    lines: Lines,
    every: Duration,
) -> Result<ExitCode> {
    // Listening from the start: a Ctrl-C during a poll is seen at the next wait.
    let mut interrupt = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())?;
    let mut follower = Follower::default();
    let mut out = std::io::stdout();
    loop {
        let job: JobView = client.get(&format!("/v1/jobs/{id}")).await?;
        let events = if show.events {
            new_events(client, id, follower.events_after()).await?
        } else {
            Vec::new()
        };
        let mut tails: Vec<Tail> = if show.output {
            client.get(&format!("/v1/jobs/{id}/logs")).await?
        } else {
            Vec::new()
        };
        if let Some(only) = &show.instance {
            tails.retain(|t| &t.instance_id == only);
        }
        for line in follower.poll(&job, &events, &tails) {
            if !show.status && matches!(line, Line::Status { .. }) {
                continue;
            }
            match lines {
                Lines::Text => writeln!(out, "{}", line.text())?,
                Lines::Json => writeln!(out, "{}", serde_json::to_string(&line)?)?,
            }
        }
        out.flush()?;
        if follower.ended() {
            return Ok(if job.state == "succeeded" {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            });
        }
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = interrupt.recv() => {
                eprintln!("stopped following job {id}; it keeps running (`proteus status {id}`)");
                return Ok(ExitCode::from(130));
            }
        }
    }
}

/// Every event after `after`, page by page.
async fn new_events(client: &Client, id: i64, after: i64) -> Result<Vec<Event>> {
    const PAGE: usize = 1000;
    let mut all = Vec::new();
    let mut after = after;
    loop {
        let page: Vec<Event> = client
            .get(&format!("/v1/jobs/{id}/events?after={after}&limit={PAGE}"))
            .await?;
        let full = page.len() == PAGE;
        if let Some(last) = page.last() {
            after = last.id;
        }
        all.extend(page);
        if !full {
            return Ok(all);
        }
    }
}

/// The line format for `--output`: following prints lines, so CSV is refused.
pub fn lines_for(output: crate::output::OutputFormat) -> Result<Lines> {
    use crate::output::OutputFormat;
    match output {
        OutputFormat::Table => Ok(Lines::Text),
        OutputFormat::Json => Ok(Lines::Json),
        OutputFormat::Csv => {
            bail!("following prints a line per change: use --output table or --output json")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tail_that_lost_its_front_adds_only_its_new_lines() {
        assert_eq!(tail_growth("", "a\nb\n"), "a\nb\n");
        assert_eq!(tail_growth("a\nb\n", "a\nb\nc\n"), "c\n");
        assert_eq!(tail_growth("a\nb\n", "a\nb\n"), "");
        // Bounded: `a` fell off the front while `c` and `d` arrived.
        assert_eq!(tail_growth("a\nb\nc\n", "b\nc\nd\n"), "d\n");
        // A line repeated: the longest overlap wins.
        assert_eq!(tail_growth("x\ny\nx\ny\n", "x\ny\nx\ny\nz\n"), "z\n");
        assert_eq!(tail_growth("x\ny\nx\n", "y\nx\nq\n"), "q\n");
        // Nothing in common: all of it is new.
        assert_eq!(tail_growth("a\nb\n", "c\nd\n"), "c\nd\n");
    }

    fn job(state: &str, progress: f64, spend: f64) -> JobView {
        let mut j: JobView = serde_json::from_value(serde_json::json!({
            "id": 7, "name": "j", "app": "mlr", "state": state, "state_reason": null, "policy": "bidbrain",
            "billing": "hourly", "created": "2015-05-01T00:00:00Z", "started": null,
            "finished": null, "progress": progress, "metric": null, "stage": null,
            "sync": "bsp", "spend_usd": spend, "budget_usd": null, "deadline": null,
            "evictions": 0, "instances_by_tier": {"reliable": 1}, "leaving_by_tier": {},
            "instances": [],
            "held": null, "unavailable_markets": [],
            "work": {"done_units": 0.0, "expected_units": null, "eta": null}
        }))
        .expect("a job view");
        if is_over(state) {
            j.state_reason = Some("training complete".into());
        }
        j
    }

    fn event(id: i64, kind: &str) -> Event {
        Event {
            id,
            time: "2015-05-01T00:01:00Z".into(),
            instance_id: None,
            kind: kind.into(),
            detail: "d".into(),
        }
    }

    #[test]
    fn each_change_is_shown_once_and_the_end_last() {
        let mut f = Follower::default();
        let first = f.poll(&job("running", 0.1, 0.01), &[event(1, "launched")], &[]);
        assert_eq!(first.len(), 2, "{first:?}");
        assert!(matches!(first[0], Line::Event { .. }));
        assert!(matches!(first[1], Line::Status { .. }));
        assert_eq!(f.events_after(), 1);
        // Nothing new: nothing printed, even if the broker repeats an event.
        assert!(
            f.poll(&job("running", 0.1, 0.01), &[event(1, "launched")], &[])
                .is_empty()
        );
        // Output grows: only the new lines.
        let tail = |o: &str| Tail {
            instance_id: "pi-1".into(),
            output: o.into(),
        };
        f.poll(&job("running", 0.1, 0.01), &[], &[tail("step 1\n")]);
        let more = f.poll(&job("running", 0.1, 0.01), &[], &[tail("step 1\nstep 2\n")]);
        assert_eq!(
            more,
            vec![Line::Output {
                instance_id: "pi-1".into(),
                text: "step 2\n".into()
            }]
        );
        assert_eq!(more[0].text(), "[pi-1] step 2");
        // The end: the status, then the end line, once.
        let end = f.poll(
            &job("succeeded", 1.0, 0.02),
            &[event(2, "job_succeeded")],
            &[],
        );
        assert!(matches!(end.last(), Some(Line::End { .. })), "{end:?}");
        assert!(f.ended());
        assert!(
            !f.poll(&job("succeeded", 1.0, 0.02), &[], &[])
                .iter()
                .any(|l| matches!(l, Line::End { .. }))
        );
    }
}
