#!/usr/bin/env python3
"""bench/command, part 3 (issue 43): no work lost at Proteus's own stops.

A command job under BidBrain (`max_instances = 3`) on a real `proteus serve --cloud sim` with
real agents, twice: a volatile 2015 window (the 2015 trace from 2015-05-01, hourly billing, where
BidBrain releases instances before their billing hours end and price spikes evict others) and
today's market (`--availability`, the 2023 16-node traces, per-second billing, capacity
interruptions). The program follows the contract: a step every 0.1 s, a periodic checkpoint every
CHECKPOINT_EVERY steps, and on a notice (SIGTERM, or the notice file) it saves and exits. The job
ends by completing (rank 0 reaches its last step: the others are stopped by the job's end) or,
when the window is over first, by a cancel.

From the programs' own output (every start and every exit, with the notice's reason) and the
checkpoints in the broker's store it counts, per scenario and overall:
  stops                     by cause: release, interruption, job_end, cancel (and layout: an
                            instance taken out of the working set, behind a leaving rank)
  steps_repeated_per_stop   by cause, the largest: the stopped run's last step minus the step
                            the rank's next run resumed from (or, at the job's end or a cancel,
                            the step of the rank's checkpoint in the store)
  runs_killed               runs SIGKILLed, or that never reported their end
  fresh_starts_after_first  starts from step 0 of a rank that had saved before
  max_rank_vs_world         the largest rank - world size at any start (must stay < 0)
Targets: zero steps repeated across a release, a job end, a cancel or a layout stop; at most one
checkpoint interval across an interruption; zero runs killed; zero fresh starts; rank < world.
Baseline, from the same runs: what each stop would have repeated without a final save (the
stopped run's last step minus its last periodic checkpoint).
Exit: 0 every target met, 1 a target missed, 2 the run failed.
"""
import argparse
import gzip
import io
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import tarfile
import time
import urllib.request

EVERY = 20
CAUSES = ["release", "interruption", "job_end", "cancel", "layout"]

PROGRAM = r'''
import json, os, signal, sys, time
every = int(os.environ["CHECKPOINT_EVERY"])
steps = int(os.environ["STEPS"])
ck = os.path.join(os.environ["PROTEUS_CHECKPOINT_DIR"], "state.json")
notice = os.environ["PROTEUS_NOTICE_FILE"]
progress = os.environ["PROTEUS_PROGRESS_FILE"]
def save(step):
    with open(ck + ".tmp", "w") as f:
        json.dump({"step": step}, f)
    os.replace(ck + ".tmp", ck)
step = 0
if os.path.exists(ck):
    step = json.load(open(ck))["step"]
got = []
signal.signal(signal.SIGTERM, lambda *_: got.append(time.time()))
print(f"start rank={os.environ['PROTEUS_RANK']} world={os.environ['PROTEUS_WORLD_SIZE']} "
      f"resumed_from={step} t={time.time():.3f}", flush=True)
while step < steps and not got and not os.path.exists(notice):
    time.sleep(0.1)
    step += 1
    with open(progress + ".tmp", "w") as f:
        json.dump({"done": step, "total": steps}, f)
    os.replace(progress + ".tmp", progress)
    if step % every == 0:
        save(step)
if step >= steps:
    save(step)
    print(f"exit at step {step} done t={time.time():.3f}", flush=True)
    sys.exit(0)
save(step)
reason = "?"
try:
    reason = json.load(open(notice)).get("reason", "?")
except (OSError, ValueError):
    pass
print(f"exit at step {step} saved t={time.time():.3f} reason={reason}", flush=True)
sys.exit(0)
'''


def fail(msg, log=None):
    print(f"bench/command (stops): FAILED: {msg}", file=sys.stderr)
    if log and os.path.exists(log):
        print(open(log).read()[-3000:], file=sys.stderr)
    sys.exit(2)


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def cause_of(reason):
    if "spot instance" in reason:
        return "interruption"
    if "released" in reason:
        return "release"
    if "taken out of the job's layout" in reason:
        return "layout"
    if "cancel" in reason:
        return "cancel"
    return "job_end"


def step_in_archive(path):
    with open(path, "rb") as f:
        data = f.read()
    with tarfile.open(fileobj=io.BytesIO(gzip.decompress(data))) as t:
        return json.load(t.extractfile("./state.json") if "./state.json" in t.getnames()
                         else t.extractfile("state.json"))["step"]


def scenario(name, proteus, work, serve_args, billing_note, window, steps, speed=300):
    """Runs one window; returns its figures."""
    d = os.path.join(work, name)
    os.makedirs(d)
    prog = os.path.join(d, "prog.py")
    with open(prog, "w") as f:
        f.write(PROGRAM)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    token = "pt_bench-stops-" + secrets.token_hex(16)
    env = dict(os.environ, PROTEUS_TOKEN=token, PROTEUS_URL=url, PROTEUS_LOG="warn")
    log = os.path.join(d, "broker.log")
    broker = subprocess.Popen(
        [proteus, "serve", "--cloud", "sim", "--listen", f"127.0.0.1:{port}",
         "--state-dir", os.path.join(d, "state"), "--database-url", f"sqlite://{d}/proteus.db",
         "--tick-ms", "250"] + serve_args,
        stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env)

    def api(path, method="GET"):
        req = urllib.request.Request(url + path, method=method,
                                     headers={"Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(req, timeout=30) as r:
            text = r.read()
            return json.loads(text) if text else None

    try:
        end = time.time() + 60
        while True:
            try:
                if urllib.request.urlopen(url + "/healthz", timeout=2).status == 200:
                    break
            except OSError:
                pass
            if time.time() > end:
                fail("the broker did not answer within 60 s", log)
            time.sleep(0.1)
        spec = os.path.join(d, "job.toml")
        with open(spec, "w") as f:
            f.write(f'''name = "bench-stops-{name}"
app = "command"
policy = "bidbrain"
[limits]
max_instances = 3
max_reliable_instances = 1
[work]
total_work = {3 * steps * 0.1 * speed / 3600:.1f}
[command]
run = ["python3", "{prog}"]
checkpoint_interval_secs = 2
grace_seconds = 10
[command.env]
CHECKPOINT_EVERY = "{EVERY}"
STEPS = "{steps}"
''')
        out = subprocess.run([proteus, "submit", spec, "--output", "json"],
                             capture_output=True, text=True, env=env)
        if out.returncode != 0:
            fail(f"submit: {out.stderr}", log)
        job = json.loads(out.stdout)["id"]
        print(f"{name}: job {job}, up to {window:.0f} wall seconds ({billing_note})", flush=True)
        end = time.time() + window
        state = "running"
        while time.time() < end:
            time.sleep(5)
            j = api(f"/v1/jobs/{job}")
            state = j.get("state")
            live = sum(1 for i in j.get("instances", []) if i.get("state") in ("running", "warned"))
            print(f"  {window - (end - time.time()):.0f} s: {live} instances live, "
                  f"progress {j.get('progress', 0):.2f}, {state}", flush=True)
            if state not in ("running", "pending"):
                break
        if state in ("running", "pending"):
            api(f"/v1/jobs/{job}/cancel", method="POST")
        # Every instance ended: the last words and checkpoints are in.
        end = time.time() + 180
        while True:
            j = api(f"/v1/jobs/{job}")
            if all(i.get("state") in ("terminated", "failed") for i in j.get("instances", [])):
                break
            if time.time() > end:
                fail("instances still live 180 s after the job's end", log)
            time.sleep(1)
        tails = {t["instance_id"]: t["output"] for t in api(f"/v1/jobs/{job}/logs")}
        events = api(f"/v1/jobs/{job}/events")
    finally:
        broker.send_signal(signal.SIGTERM)
        try:
            broker.wait(timeout=30)
        except subprocess.TimeoutExpired:
            broker.kill()
        for f in os.listdir(os.path.join(d, "state", "agents")) if os.path.isdir(
                os.path.join(d, "state", "agents")) else []:
            if f.endswith(".pid"):
                try:
                    os.kill(int(open(os.path.join(d, "state", "agents", f)).read()), signal.SIGKILL)
                except (OSError, ValueError):
                    pass

    # One record per run: rank, world, start t, resumed_from, exit step, exit t, cause.
    runs, killed = [], 0
    for iid, text in tails.items():
        killed += text.count("SIGKILL")
        run = None
        for line in text.splitlines():
            m = re.match(r"start rank=(\d+) world=(\d+) resumed_from=(\d+) t=([0-9.]+)", line)
            if m:
                if run is not None and run["exit"] is None:
                    killed += 1  # a run that never reported its end
                run = {"rank": int(m.group(1)), "world": int(m.group(2)),
                       "t": float(m.group(4)), "from": int(m.group(3)), "exit": None,
                       "exit_t": None, "cause": None, "iid": iid}
                runs.append(run)
                continue
            m = re.match(r"exit at step (\d+) (saved|done) t=([0-9.]+)(?: reason=(.*))?", line)
            if m and run is not None:
                run["exit"], run["exit_t"] = int(m.group(1)), float(m.group(3))
                run["cause"] = None if m.group(2) == "done" else cause_of(m.group(4) or "")
            # The broker may learn of an interruption before the agent reads its own notice:
            # the program is then told first that its instance left the layout. The run's
            # cause is the interruption.
            if (run is not None and run["cause"] == "layout" and "notice delivered" in line
                    and "spot instance" in line):
                run["cause"] = "interruption"
        if run is not None and run["exit"] is None:
            killed += 1
    store = os.path.join(d, "state", "checkpoints", f"job-{job}")
    stops = {c: 0 for c in CAUSES}
    repeated = {c: 0 for c in CAUSES}
    baseline = {c: 0 for c in CAUSES}
    for r in runs:
        if r["cause"] is None:
            continue
        c = r["cause"]
        stops[c] += 1
        later = sorted((s for s in runs if s["rank"] == r["rank"] and s["t"] > r["exit_t"]),
                       key=lambda s: s["t"])
        if later:
            resumed = later[0]["from"]
        else:
            path = os.path.join(store, f"rank-{r['rank']}.tar.gz")
            resumed = step_in_archive(path) if os.path.exists(path) else 0
        repeated[c] = max(repeated[c], r["exit"] - resumed)
        baseline[c] = max(baseline[c], r["exit"] - (r["exit"] // EVERY) * EVERY)
    fresh, saved_before = 0, {}
    for r in sorted(runs, key=lambda r: r["t"]):
        if r["from"] == 0 and saved_before.get(r["rank"], 0) > 0:
            fresh += 1
        if r["exit"]:
            saved_before[r["rank"]] = max(saved_before.get(r["rank"], 0), r["exit"])
    max_rank_vs_world = max((r["rank"] - r["world"] for r in runs), default=-1)
    kinds = {}
    for e in events:
        kinds[e["kind"]] = kinds.get(e["kind"], 0) + 1
    print(f"{name}: {len(runs)} runs on {len(tails)} instances; stops {stops}; "
          f"events: releases asked {kinds.get('instance_stopping', 0)}, "
          f"evictions {kinds.get('evicted', 0)}")
    return {"stops": stops, "steps_repeated_per_stop": repeated, "baseline": baseline,
            "runs_killed": killed, "fresh_starts_after_first": fresh,
            "max_rank_vs_world": max_rank_vs_world}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--proteus", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--json", default="")
    ap.add_argument("--window", type=float, default=240)
    args = ap.parse_args()
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    today = os.path.join(here, "data/spot/skypilot-spot-traces/availability/1-node/aws-02-15-2023")
    traces = sorted(os.path.join(today, f) for f in os.listdir(today)
                    if f.startswith("us-east-1") and f.endswith(".json"))
    figures = {
        "2015-05 (volatile, hourly billing)": scenario(
            "y2015", args.proteus, args.work,
            ["--speed", "300", "--start", "2015-05-01T00:00:00Z"],
            "2015 trace, speed 300", args.window, 2000),
        "today (2023 availability)": scenario(
            "today", args.proteus, args.work,
            ["--speed", "300", "--availability"] + traces +
            ["--region", "us-east-1", "--billing", "per-second", "--market-model", "hazard"],
            "2023 availability, us-east-1, speed 300", args.window, 6000),
    }
    total = {"stops": {c: 0 for c in CAUSES}, "steps_repeated_per_stop": {c: 0 for c in CAUSES},
             "runs_killed": 0, "fresh_starts_after_first": 0, "max_rank_vs_world": -10**9,
             "checkpoint_interval_steps": EVERY}
    base = {c: 0 for c in CAUSES}
    for f in figures.values():
        for c in CAUSES:
            total["stops"][c] += f["stops"][c]
            total["steps_repeated_per_stop"][c] = max(total["steps_repeated_per_stop"][c],
                                                      f["steps_repeated_per_stop"][c])
            base[c] = max(base[c], f["baseline"][c])
        total["runs_killed"] += f["runs_killed"]
        total["fresh_starts_after_first"] += f["fresh_starts_after_first"]
        total["max_rank_vs_world"] = max(total["max_rank_vs_world"], f["max_rank_vs_world"])
    ok = True
    print()
    for name, f in list(figures.items()) + [("both", dict(total, baseline=base))]:
        print(f"{name}:")
        for c in CAUSES:
            target = EVERY if c == "interruption" else 0
            got = f["steps_repeated_per_stop"][c]
            met = got <= target
            ok &= met or name != "both"
            b = f["baseline"][c]
            ratio = f"{got / b:.2f}" if b else "-"
            print(f"  {c:12} stops {f['stops'][c]:3}  steps repeated, largest {got:3} "
                  f"(target <= {target}; baseline without a final save {b}: ratio {ratio})"
                  f"{'' if met else '  MISSED'}")
        print(f"  runs killed {f['runs_killed']} (target 0); fresh starts of a rank with a "
              f"checkpoint {f['fresh_starts_after_first']} (target 0); largest rank - world "
              f"{f['max_rank_vs_world']} (target < 0)")
    ok &= (total["runs_killed"] == 0 and total["fresh_starts_after_first"] == 0
           and total["max_rank_vs_world"] < 0)
    if sum(total["stops"].values()) == 0:
        fail("no program was stopped in either window")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(total, f, indent=2)
    print("targets met" if ok else "a target was missed")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
