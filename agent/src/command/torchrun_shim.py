"""torchrun as the Proteus agent runs it (`launcher = "torchrun"`, see docs/command-jobs.md).

`python3 <this file> <torchrun arguments>` is `torchrun <torchrun arguments>` with two changes,
both for a node that leaves the job while the others go on:

1. A warned node leaves the rendezvous instead of closing it. On SIGTERM torchrun stops its
   workers and then calls the rendezvous handler's `shutdown()`, which *closes* the rendezvous
   for every node: the survivors' next round fails with RendezvousClosedError and the whole
   job stops. When the agent delivered a notice (the file `PROTEUS_NOTICE_FILE` exists),
   `shutdown()` here removes this node from the participants instead (the same exit step a
   node takes before each new round), so the survivors' next round forms at once without it,
   rather than after torch's 15 s keep-alive expiry. Without a notice (the job is over or
   cancelled) torchrun closes the rendezvous as usual.
2. Workers die with torchrun. torchrun starts each worker in a new session, out of reach of the
   agent's signals to its process group; a SIGKILLed torchrun (the kill margin) would leave
   them running. Each worker gets PR_SET_PDEATHSIG=SIGKILL.
3. A node that leaves at the very end does not hold the others for five minutes. When its
   workers finish, torchrun waits in an exit barrier (300 s) for every node of the round; a
   node warned or released by the policy between the last step and that barrier never comes,
   and the survivors' torchrun would sit there long after the training is done. Proteus ends
   the job when the first node's program exits with its work done (and stops the others), so
   the barrier here waits at most `EXIT_BARRIER_SECS` (10 s).
"""

import ctypes
import os
import signal
import sys

from torch.distributed.elastic.agent.server.api import SimpleElasticAgent
from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler
from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

EXIT_BARRIER_SECS = 10.0

_libc = ctypes.CDLL(None, use_errno=True)
_PR_SET_PDEATHSIG = 1


def _die_with_parent():
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


_popen = subprocess_handler.SubprocessHandler._popen


def _popen_tied(self, args, env):
    import subprocess

    real = subprocess.Popen

    def popen(*a, **kw):
        kw.setdefault("preexec_fn", _die_with_parent)
        return real(*a, **kw)

    subprocess.Popen = popen
    try:
        return _popen(self, args, env)
    finally:
        subprocess.Popen = real


_shutdown = dr.DynamicRendezvousHandler.shutdown


def _shutdown_or_leave(self):
    notice = os.environ.get("PROTEUS_NOTICE_FILE")
    if not (notice and os.path.exists(notice)):
        return _shutdown(self)
    self._stop_heartbeats()
    try:
        deadline = self._get_deadline(self._settings.timeout.close)
        self._op_executor.run(dr._RendezvousExitOp(), deadline)
        print(f"[proteus-torchrun] left the rendezvous {self._settings.run_id} after a notice",
              file=sys.stderr, flush=True)
        return True
    except Exception as e:  # the survivors still drop us after the keep-alive expiry
        print(f"[proteus-torchrun] could not leave the rendezvous: {e!r}", file=sys.stderr,
              flush=True)
        return False


_exit_barrier = SimpleElasticAgent._exit_barrier


def _exit_barrier_bounded(self):
    self._exit_barrier_timeout = min(self._exit_barrier_timeout, EXIT_BARRIER_SECS)
    return _exit_barrier(self)


subprocess_handler.SubprocessHandler._popen = _popen_tied
SimpleElasticAgent._exit_barrier = _exit_barrier_bounded
dr.DynamicRendezvousHandler.shutdown = _shutdown_or_leave

if __name__ == "__main__":
    from torch.distributed.run import main

    sys.argv[0] = "torchrun"
    sys.exit(main())
