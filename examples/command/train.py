#!/usr/bin/env python3
"""A toy training loop that follows Proteus's command-job contract (docs/command-jobs.md).

Standard library only. It "trains" for STEPS steps of STEP_SECS each, keeps its state in
$PROTEUS_CHECKPOINT_DIR (written atomically every CHECKPOINT_EVERY steps, and at once when a
notice arrives), reports {"done", "total"} in $PROTEUS_PROGRESS_FILE, and on SIGTERM (or when
$PROTEUS_NOTICE_FILE appears) saves and exits 0 so the replacement resumes where it stopped.

Knobs (environment, all optional) used by the end-to-end tests:
  STEPS=100 STEP_SECS=0.2 CHECKPOINT_EVERY=5
  IGNORE_SIGTERM=1   ignore the notice entirely (the agent SIGKILLs it at the margin)
  FAIL_AT_STEP=N     exit 3 at step N, every time (exhausts max_restarts)
  FAIL_ONCE_AT_STEP=N exit 3 at step N the first time only (a marker in the checkpoint dir)
  SAVE_SECS=S        the save on a notice takes S seconds (a large model's state)
"""
import json
import os
import signal
import sys
import time

steps = int(os.environ.get("STEPS", "100"))
step_secs = float(os.environ.get("STEP_SECS", "0.2"))
every = int(os.environ.get("CHECKPOINT_EVERY", "5"))
ignore_sigterm = os.environ.get("IGNORE_SIGTERM") == "1"
fail_at = int(os.environ.get("FAIL_AT_STEP", "-1"))
fail_once_at = int(os.environ.get("FAIL_ONCE_AT_STEP", "-1"))
save_secs = float(os.environ.get("SAVE_SECS", "0"))

ckpt_dir = os.environ["PROTEUS_CHECKPOINT_DIR"]
notice_file = os.environ["PROTEUS_NOTICE_FILE"]
progress_file = os.environ["PROTEUS_PROGRESS_FILE"]
rank = os.environ["PROTEUS_RANK"]
world = os.environ["PROTEUS_WORLD_SIZE"]
state_file = os.path.join(ckpt_dir, "state.json")
failed_marker = os.path.join(ckpt_dir, "failed-once")


def write_atomic(path, obj):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def save(step):
    os.makedirs(ckpt_dir, exist_ok=True)
    write_atomic(state_file, {"step": step})
    print(f"checkpoint {step}", flush=True)


step = 0
if os.path.exists(state_file):
    with open(state_file) as f:
        step = json.load(f)["step"]
print(f"start rank={rank} world={world} resumed_from={step}", flush=True)

noticed = False


def on_sigterm(signum, frame):
    global noticed
    noticed = True
    # The contract: the notice file is in place before SIGTERM, on every path.
    have = "yes" if os.path.exists(notice_file) else "no"
    print(f"sigterm notice_file={have}", flush=True)


signal.signal(signal.SIGTERM, signal.SIG_IGN if ignore_sigterm else on_sigterm)

while step < steps:
    time.sleep(step_secs)
    step += 1
    print(f"step {step}", flush=True)
    write_atomic(progress_file, {"done": step, "total": steps})
    if step % every == 0:
        save(step)
    if step == fail_at:
        print(f"failing at step {step}", flush=True)
        sys.exit(3)
    if step == fail_once_at and not os.path.exists(failed_marker):
        open(failed_marker, "w").close()
        print(f"failing once at step {step}", flush=True)
        sys.exit(3)
    if not ignore_sigterm and (noticed or os.path.exists(notice_file)):
        print(f"notice: saving step {step}", flush=True)
        time.sleep(save_secs)
        save(step)
        print(f"notice: saved step {step}, exiting", flush=True)
        sys.exit(0)

save(step)
print("done", flush=True)
