"""The wire format between workers and servers, and waiting without burning a core.

Every message is a numpy buffer sent with mpi4py's upper-case (buffer) API, never a
pickle. A data message is one uint8 buffer: a fixed 128-byte header of int64/float64
fields followed by the float32 payload, both numpy views of the same memory, so a push
or a reply is a single MPI message with no copy. Control messages are 8 int64s.

Tags: PUSH (worker -> server: header + gradient), PULL (worker -> server: request the
current parameters), CTRL (worker -> server: heartbeat, done, ready to save), REPLY
(server -> worker: header + parameters, carrying the server's version), SAVE (server 0
-> a worker or another server: an async checkpoint goes ahead or is called off).

MPI's blocking waits spin (Open MPI polls, at best yielding), which on an oversubscribed
node steals the core a worker needs for its gradients. `poll` instead tests the posted
requests, spinning for 200 us after the last event (replies usually come that fast) and
then sleeping with exponential backoff (50 us doubling up to `ps.poll_max_sleep_ms`)
while nothing arrives; the cap bounds the added latency.
"""

from __future__ import annotations

import numpy as np

from ...runtime.p2p import Backoff, poll, wait_all  # noqa: F401 - re-exported for the PS

TAG_PUSH, TAG_PULL, TAG_CTRL, TAG_REPLY, TAG_SAVE = 7101, 7102, 7103, 7104, 7105
HEARTBEAT, DONE, SAVE_READY = 1, 2, 3  # CTRL ops
CANCEL, GO = 0, 1  # SAVE messages
OK, REJECTED, STOPPED = 0, 1, 2  # REPLY status

HEADER_BYTES = 128
# int64 header fields (index into the 16-int64 header view)
H_WORKER, H_VERSION, H_STEP, H_STATUS, H_STALENESS, H_PUSHES, H_REJECTED = range(7)
H_LR = 7  # float64 (a reply's learning rate)
H_FLAGS = 8  # push: what this worker asks for; reply: what every rank does after this step
# H_FLAGS bits. A push carries its worker's wish (a checkpoint is due by its clock, or it
# got a preemption signal); in sync mode the server ORs the wishes of one version's pushes
# and returns the result in every reply of that version, so all ranks act at the same step.
# In async and bounded mode only worker 0's save wish counts: server 0 then sets FLAG_SAVE
# in every reply until every worker has answered SAVE_READY (then a GO to every rank: the
# save) or one finished, was dropped or a preemption came (a CANCEL to those waiting).
FLAG_SAVE, FLAG_PREEMPT = 1, 2


class Message:
    """A header + float32 payload sharing one contiguous uint8 buffer."""

    def __init__(self, n: int):
        self.buf = np.zeros(HEADER_BYTES + 4 * n, dtype=np.uint8)
        self.header = self.buf[:HEADER_BYTES].view(np.int64)
        self.payload = self.buf[HEADER_BYTES:].view(np.float32)

    @property
    def lr(self) -> float:
        return float(self.header[H_LR:].view(np.float64)[0])

    @lr.setter
    def lr(self, value: float) -> None:
        self.header[H_LR:].view(np.float64)[0] = value

    @property
    def nbytes(self) -> int:
        return self.buf.nbytes


def ctrl(op: int, worker: int, value: int = 0) -> np.ndarray:
    msg = np.zeros(8, dtype=np.int64)
    msg[0], msg[1], msg[2] = op, worker, value
    return msg
