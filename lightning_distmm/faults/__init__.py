"""When something goes wrong in a distmm job: every rank ends, and each ends with the root cause.

Three parts, none of which needs Lightning:

- :class:`ErrorRelay`: each rank writes the first error it saw to a file of its own in the run's
  folder (under the host's temporary folder; the ranks of other hosts are reached through the
  torch.distributed store while its host lives), with the time it happened and whether it is a *consequence* (a peer closed its
  connection mid-collective, a collective timed out) or a *root cause* (anything else). A rank
  that fails reads every rank's record and reports the earliest root cause, falling back to the
  earliest consequence. Files survive the death of any rank, rank 0 (which hosts the
  torch.distributed store) included. A rank the others named stalled reads that it did, and says so
  as its last line.
- :class:`ParentWatchdog`: a daemon thread that ends its process when the process that started
  it (Lightning's launcher, which is rank 0 under the subprocess launcher, torchrun's agent, the
  spawn/fork parent) is gone, so no rank outlives its job waiting on a collective.
- :class:`NodeHeartbeat`: over several nodes, each node's first rank beats for its node in the
  job's store and watches the others' beats, so that a lost machine (which records nothing) ends
  every other node's ranks, naming it; a store that stops answering names rank 0's node.
- :func:`preemption_handler`: SIGTERM (a scheduler's preemption) ends the rank that receives it
  at once with :class:`Preempted`, a root cause the relay hands to every other rank. Lightning's
  own handler broadcasts from inside the signal handler, a collective the other ranks never
  join, which leaves every rank waiting until the collective timeout.
"""

from lightning_distmm.faults.heartbeat import NODE_LOST, NodeHeartbeat
from lightning_distmm.faults.records import (
    STALLED,
    ErrorRelay,
    FailureRecord,
    earliest_cause,
    is_consequence,
    stalled_here,
)
from lightning_distmm.faults.runs import (
    LAUNCHER_PID_ENV,
    RUN_ID_ENV,
    current_run_id,
    ensure_run_id,
    expected_parent,
    note_launcher,
    pid_alive,
    remove_stale_runs,
    started_by_our_launcher,
)
from lightning_distmm.faults.watch import (
    ParentWatchdog,
    PeerFailureWatch,
    Preempted,
    dies_with_parent,
    launcher_last_words,
    preemption_handler,
)

__all__ = [
    "LAUNCHER_PID_ENV",
    "NODE_LOST",
    "NodeHeartbeat",
    "RUN_ID_ENV",
    "STALLED",
    "ErrorRelay",
    "FailureRecord",
    "ParentWatchdog",
    "PeerFailureWatch",
    "Preempted",
    "current_run_id",
    "dies_with_parent",
    "earliest_cause",
    "ensure_run_id",
    "expected_parent",
    "is_consequence",
    "launcher_last_words",
    "note_launcher",
    "pid_alive",
    "preemption_handler",
    "remove_stale_runs",
    "stalled_here",
    "started_by_our_launcher",
]
