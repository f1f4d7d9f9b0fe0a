"""Driver of bench/torchrun (see there). argv: REPO RUNS."""
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

repo, runs = sys.argv[1], int(sys.argv[2])
shim = os.path.join(repo, "agent/src/command/torchrun_shim.py")
program = os.path.join(repo, "examples/command/torch_train.py")
TARGET = 30.0


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Node:
    def __init__(self, work, n, port, rdzv_id):
        self.dir = os.path.join(work, f"node{n}")
        os.makedirs(self.dir)
        self.notice = os.path.join(self.dir, "notice.json")
        self.lines = []  # (time, line)
        self.lock = threading.Lock()
        env = dict(os.environ,
                   PROTEUS_CHECKPOINT_DIR=os.path.join(self.dir, "checkpoint"),
                   PROTEUS_NOTICE_FILE=self.notice,
                   PROTEUS_PROGRESS_FILE=os.path.join(self.dir, "progress.json"),
                   PROTEUS_RANK=str(n), PROTEUS_WORLD_SIZE="3",
                   STEPS="100000", STEP_SECS="0.05", CHECKPOINT_EVERY="5",
                   OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
        argv = ["python3", shim, "--nnodes=1:3", "--nproc-per-node=1", "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={rdzv_id}",
                f"--rdzv-conf=is_host={int(n == 0)},last_call_timeout=2",
                "--max-restarts=1000", "--monitor-interval=0.5", "--no-python",
                "python3", program]
        self.proc = subprocess.Popen(argv, env=env, cwd=self.dir, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            with self.lock:
                self.lines.append((time.time(), line.rstrip("\n")))

    def first_step(self, world, after):
        with self.lock:
            for t, l in self.lines:
                if t >= after and l.startswith("step ") and f" world={world} " in l:
                    return t
        return None

    def stop(self):
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()
        # the worker lives in its own session; PR_SET_PDEATHSIG (the shim) takes it down


def wait_for(cond, timeout, what, nodes):
    deadline = time.time() + timeout
    while time.time() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(0.05)
    for i, n in enumerate(nodes):
        print(f"--- node {i}", file=sys.stderr)
        for _, l in n.lines[-30:]:
            print(l, file=sys.stderr)
    raise SystemExit(f"bench/torchrun: timed out waiting for {what}")


def one(mode, k):
    work = tempfile.mkdtemp(prefix="proteus-bench-torchrun.")
    port = free_port()
    nodes = [Node(work, n, port, f"bench-{mode}-{k}") for n in range(3)]
    try:
        wait_for(lambda: all(n.first_step(3, 0) for n in nodes), 180, "three nodes training", nodes)
        time.sleep(1.0)  # a few steps in world 3
        victim = nodes[2]
        t0 = time.time()
        if mode == "notice":
            with open(victim.notice, "w") as f:
                f.write('{"action": "terminate", "deadline": "", "reason": "bench"}')
            os.killpg(victim.proc.pid, signal.SIGTERM)
        else:
            os.killpg(victim.proc.pid, signal.SIGKILL)
        t = wait_for(lambda: all(n.first_step(2, t0) for n in nodes[:2]) and
                     max(n.first_step(2, t0) for n in nodes[:2]), 120,
                     "the survivors training in a world of 2", nodes)
        return t - t0
    finally:
        for n in nodes:
            n.stop()
        shutil.rmtree(work, ignore_errors=True)


results = {"notice": [], "kill": []}
for k in range(runs):
    for mode in ("notice", "kill"):
        secs = one(mode, k)
        results[mode].append(secs)
        print(f"run {k + 1} {mode:6}: survivors training again {secs:.2f} s after the signal",
              flush=True)
med = {m: statistics.median(v) for m, v in results.items()}
ratio = med["notice"] / med["kill"]
print(f"notice -> survivors training again (torchrun, clean leave): median {med['notice']:.2f} s "
      f"over {runs} runs; target < {TARGET:.0f} s")
print(f"baseline, node lost without a notice (torchrun's own detection): median {med['kill']:.2f} s")
print(f"ratio notice/baseline: {ratio:.2f}")
sys.exit(0 if med["notice"] < TARGET else 1)
