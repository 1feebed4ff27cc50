"""Process 0 -> every process of a multi-host mesh: what the runner launches next.

    process 0: engine schedules, runner.sample(...) ── send(STEP, host_step) ──> process k: follow()
               runner.reset_state()               ── send(RESET) ──────────>   fresh KV, slots
               runner.close()                     ── send(STOP) ───────────>   follow() returns

Each message is two broadcasts (sharding.distributed.broadcast_from_process0, jax's own
multihost utilities over the job's devices): a fixed header [op, rows, tokens, width, has_bias,
seq], then, for STEP, the HostStep packed into one int32 vector whose length the header fixes.
Every payload length is one of the bucket plan's (with and without a bias), so `warmup` compiles
them all and serving never compiles.  The sequence number catches a process that lost step.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import IntEnum

import jax
import numpy as np

from xlaserve.serving.runner.host_step import HostStep
from xlaserve.sharding.distributed import broadcast_from_process0

HEADER = 6


class Op(IntEnum):
    STEP = 1
    RESET = 2
    STOP = 3


def pack(arrays: Sequence[np.ndarray]) -> np.ndarray:
    """Arrays of 4-byte dtypes (and bool) -> one flat int32 vector, bit for bit."""
    parts = [(a.astype(np.int32) if a.dtype == np.bool_ else np.ascontiguousarray(a))
             .view(np.int32).ravel() for a in arrays]
    return np.concatenate(parts) if parts else np.zeros(0, np.int32)


def unpack(flat: np.ndarray, specs: Sequence[tuple[tuple[int, ...], np.dtype]]) -> list[np.ndarray]:
    out, at = [], 0
    for shape, dtype in specs:
        n = int(np.prod(shape))
        chunk = flat[at:at + n].reshape(shape)
        out.append(chunk.astype(np.bool_) if dtype == np.bool_ else chunk.view(dtype))
        at += n
    assert at == flat.size, (at, flat.size)
    return out


def payload_size(shape: tuple[int, int, int], vocab: int | None) -> int:
    return sum(int(np.prod(s)) for s, _ in HostStep.specs(*shape, vocab))


class StepChannel:
    def __init__(self, vocab_size: int, timeout_s: float | None = 60.0):
        """`timeout_s`: how long process 0 waits on a broadcast before PeerTimeout (followers
        wait for work without a deadline; a dead process 0 fails them through jax's heartbeat
        or the collective's own error)."""
        self.vocab_size = vocab_size
        self.is_leader = jax.process_index() == 0
        self.timeout_s = timeout_s
        self.seq = 0

    def _broadcast(self, x: np.ndarray) -> np.ndarray:
        timeout = self.timeout_s if self.is_leader else None
        return np.asarray(broadcast_from_process0(x, timeout))

    def send(self, op: Op, host: HostStep | None = None) -> None:
        """Process 0: announce `op` (and its inputs) to every process."""
        assert self.is_leader
        self.seq += 1
        if op is Op.STEP:
            assert host is not None
            if host.draft_probs is not None:
                raise ValueError("draft-model speculation with sampled drafts runs on one "
                                 "process: a multi-host step cannot carry draft_probs")
            r, t, w = host.shape
            header = np.array([op, r, t, w, host.bias is not None, self.seq], np.int32)
            self._broadcast(header)
            self._broadcast(pack(host.arrays()))
        else:
            self._broadcast(np.array([op, 0, 0, 0, 0, self.seq], np.int32))

    def receive(self) -> tuple[Op, HostStep | None]:
        """Other processes: the next op from process 0 (blocks until it sends one)."""
        assert not self.is_leader
        header = self._broadcast(np.zeros(HEADER, np.int32))
        op, r, t, w, has_bias, seq = (int(v) for v in header)
        self.seq += 1
        if seq != self.seq:
            raise RuntimeError(f"process {jax.process_index()}: expected message {self.seq} "
                               f"from process 0, got {seq}")
        if op != Op.STEP:
            return Op(op), None
        vocab = self.vocab_size if has_bias else None
        flat = self._broadcast(np.zeros(payload_size((r, t, w), vocab), np.int32))
        return Op.STEP, HostStep.from_arrays(unpack(flat, HostStep.specs(r, t, w, vocab)))

    def warmup(self, shapes: Sequence[tuple[int, int, int]]) -> None:
        """Compile the broadcasts of the header and of every payload length (collectives:
        every process calls this with the same shapes, in the same order)."""
        self._broadcast(np.zeros(HEADER, np.int32))
        sizes = sorted({payload_size(s, v) for s in shapes for v in (None, self.vocab_size)})
        for n in sizes:
            self._broadcast(np.zeros(n, np.int32))
