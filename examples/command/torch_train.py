#!/usr/bin/env python3
"""Data-parallel training under `launcher = "torchrun"` (docs/command-jobs.md): a small MLP on
the 8x8 digits (data/ml/digits-8x8.csv.gz), gloo on CPU, one worker per instance.

torchrun gives the worker RANK/WORLD_SIZE/MASTER_ADDR (its own, per rendezvous round); the
Proteus contract gives the checkpoint directory, the notice file and the progress file. Every
round starts the same way: each worker loads its local checkpoint, the workers agree on the
newest step (all_reduce MAX) and the holder of it broadcasts the model, so a survivor, a
replacement and a fresh node all continue from the newest checkpoint anyone has.

Each step is one all_reduce of the gradients (DDP), so a lost peer fails the survivors' next
step at once; torchrun then restarts them in a new round without the peer.

Knobs: STEPS=300 STEP_SECS=0.05 CHECKPOINT_EVERY=5 BATCH=64 LR=0.1 DATA=<digits csv.gz>
"""
import csv
import datetime
import gzip
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

steps = int(os.environ.get("STEPS", "300"))
step_secs = float(os.environ.get("STEP_SECS", "0.05"))
every = int(os.environ.get("CHECKPOINT_EVERY", "5"))
batch = int(os.environ.get("BATCH", "64"))
lr = float(os.environ.get("LR", "0.1"))
here = os.path.dirname(os.path.abspath(__file__))
data = os.environ.get("DATA", os.path.join(here, "../../data/ml/digits-8x8.csv.gz"))

ckpt_dir = os.environ["PROTEUS_CHECKPOINT_DIR"]
notice_file = os.environ["PROTEUS_NOTICE_FILE"]
progress_file = os.environ["PROTEUS_PROGRESS_FILE"]
state_file = os.path.join(ckpt_dir, "state.pt")

noticed = False


def on_sigterm(signum, frame):
    global noticed
    noticed = True


# While joining (a C++ call that a Python handler cannot interrupt) SIGTERM keeps its default
# action, so a worker torchrun stops mid-join dies at once instead of after torchrun's 30 s.
signal.signal(signal.SIGTERM, signal.SIG_DFL)


def write_progress(step):
    tmp = progress_file + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"done": step, "total": steps}, f)
    os.replace(tmp, progress_file)


def save(model, step):
    os.makedirs(ckpt_dir, exist_ok=True)
    tmp = state_file + ".tmp"
    torch.save({"step": step, "model": model.state_dict()}, tmp)
    os.replace(tmp, state_file)


with gzip.open(data, "rt") as f:
    rows = [list(map(float, r)) for r in csv.reader(f) if r and r[0][0].isdigit()]
xs = torch.tensor([r[1:] for r in rows]) / 16.0
ys = torch.tensor([int(r[0]) for r in rows])

# A bounded timeout: a round broken by another membership change fails fast and torchrun
# starts the next one (gloo's default is 30 minutes).
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))

# Resume from the newest checkpoint any worker holds.
step = 0
if os.path.exists(state_file):
    saved = torch.load(state_file, weights_only=True)
    model.load_state_dict(saved["model"])
    step = saved["step"]
newest = torch.tensor([step])
dist.all_reduce(newest, op=dist.ReduceOp.MAX)
holder = torch.tensor([rank if step == newest.item() else world])
dist.all_reduce(holder, op=dist.ReduceOp.MIN)
for p in model.parameters():
    dist.broadcast(p.data, src=holder.item())
resumed = step
step = int(newest.item())
print(
    f"start rank={rank} world={world} local={resumed} resumed_from={step} "
    f"proteus_rank={os.environ['PROTEUS_RANK']} "
    f"restart={os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')} t={time.time():.3f}",
    flush=True,
)

signal.signal(signal.SIGTERM, on_sigterm)
opt = torch.optim.SGD(model.parameters(), lr=lr)
loss_fn = torch.nn.CrossEntropyLoss()
while step < steps and not noticed and not os.path.exists(notice_file):
    # Step s trains on the same global batch whatever the world; each worker its slice.
    g = torch.Generator().manual_seed(step)
    idx = torch.randint(0, len(ys), (batch,), generator=g)[rank::world]
    opt.zero_grad()
    loss = loss_fn(model(xs[idx]), ys[idx])
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
        p.grad /= world
    opt.step()
    step += 1
    print(f"step {step} world={world} loss={loss.item():.4f}", flush=True)
    if step % every == 0 or step == steps:
        save(model, step)
    write_progress(step)
    time.sleep(step_secs)

save(model, step)
write_progress(step)
if step >= steps:
    with torch.no_grad():
        acc = (model(xs).argmax(1) == ys).float().mean().item()
    print(f"done step={step} accuracy={acc:.3f}", flush=True)
    dist.destroy_process_group()
    sys.exit(0)
# A notice: the checkpoint is saved; leave without waiting for the peers.
print(f"noticed at step {step}: saved, leaving", flush=True)
sys.exit(0)
