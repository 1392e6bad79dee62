"""A simulated round's clients (fedsd.secure.distributed_step.secure_round) in groups, so that a
simulation of hundreds of owners uses every core, as a Ray simulation spreads Flower's clients:
`Group`, some of the round's SecAggClients, each stage one call over its members; `Workers`,
processes that each hold a group, started once a run (`spawn`, never a fork of a process with
torch's threads) and stopped with it; `Groups`, the round's groups, in this process or one in each
worker, each stage's requests sent to every worker before any answer is read.

Every client runs its stages as an owner's service does, and the server's side is the same: only
where a client's work runs changes. The masked vectors stay where the server sums them: in
shared memory, which each worker masks in place (never copied through a pipe). Each group makes
each of its pairs' agreement once (SecAggClient.agreements); the groups are cut from the ring's
order, so few pairs span two of them.
"""
from __future__ import annotations

import multiprocessing
import os
from multiprocessing import shared_memory

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from fedsd.secure.identity import Identity, Roster
from fedsd.secure.secagg import SecAggClient

STAGES = ("advertise", "share_keys", "confirm", "unmask")  # one call a client; the masked input: `Group.masked`
WORKERS_FROM = 64  # clients a round from which a simulation spreads them over the cores (below: one process)


class Group:
    """Some of a round's clients, each with its identity on the run's roster (`members`: id → its
    identity's private bytes; `roster`: name → public key), sharing each pair's agreement."""

    def __init__(self, round_id: bytes, members: dict[int, bytes], roster: dict[str, bytes], min_cohort: int,
                 max_colluders: int):
        on_roster, agreements = Roster.of(roster), {}
        self.clients = {i: SecAggClient(i, round_id, min_cohort=min_cohort, max_colluders=max_colluders,
                                        identity=Identity(Ed25519PrivateKey.from_private_bytes(raw)),
                                        roster=on_roster, agreements=agreements) for i, raw in members.items()}

    def call(self, stage: str, requests: dict[int, dict]) -> dict:
        """One of STAGES for each client named: its answer."""
        if stage not in STAGES:
            raise ValueError(f"a group's stage is one of {STAGES}, not {stage!r}")
        return {i: getattr(self.clients[i], stage)(**kwargs) for i, kwargs in requests.items()}

    def masked(self, requests: dict[int, tuple[dict, int]], rows: np.ndarray) -> dict[int, dict | None]:
        """Stage 2: each client's shares and the row of `rows` that holds its vector, masked there in
        place; each one's signed M on a ring (None on the complete graph)."""
        out = {}
        for i, (shares, row) in requests.items():
            client = self.clients[i]
            rows[row] = client.masked_input(shares["ciphertexts"], shares["commits"], rows[row])
            out[i] = client.masked_set() if client.degree else None
        return out


def _serve(connection) -> None:
    """A worker: holds one group at a time and answers its calls (an exception goes back as the answer)."""
    group, memory = None, None
    while True:
        message = connection.recv()
        if message is None:
            break
        op, args = message
        try:
            if op == "ready":
                out = None
            elif op == "start":
                group = Group(*args)
                out = None
            elif op == "masked":
                requests, name, shape = args
                memory = shared_memory.SharedMemory(name=name)
                try:
                    out = group.masked(requests, np.ndarray(shape, dtype=np.uint64, buffer=memory.buf))
                finally:
                    memory.close()
            else:
                out = group.call(op, args)
            connection.send((True, out))
        except Exception as e:  # noqa: BLE001 - the caller raises it, as an in-process client's would be
            connection.send((False, e))


class Workers:
    """`count` worker processes for a run's simulated clients, started when first used (`start`
    returns once each is ready)."""

    def __init__(self, count: int):
        self.count, self.pipes, self.processes = count, [], []

    def start(self) -> None:
        if self.processes:
            return
        context = multiprocessing.get_context("spawn")
        for _ in range(self.count):
            parent, child = context.Pipe()
            process = context.Process(target=_serve, args=(child,), daemon=True, name="fedsd-secagg-clients")
            process.start()
            child.close()
            self.pipes.append(parent)
            self.processes.append(process)
        for pipe in self.pipes:  # each has imported what it runs: none of that in a round's seconds
            pipe.send(("ready", None))
        for pipe in self.pipes:
            pipe.recv()

    def close(self) -> None:
        for pipe in self.pipes:
            try:
                pipe.send(None)
            except OSError:
                pass
        for process in self.processes:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
        self.pipes, self.processes = [], []

    @staticmethod
    def for_cohort(n: int) -> "Workers | None":
        """Workers, one a core (at most 8), for a cohort of at least WORKERS_FROM on a machine of two
        cores or more; else None (one process)."""
        cores = min(len(os.sched_getaffinity(0)), 8)
        return Workers(cores) if n >= WORKERS_FROM and cores > 1 else None


class Groups:
    """A round's clients (`identities`, on the run's `roster`): one group in this process (`workers`
    None), or one in each worker, cut from `order` (the ring's, so that few pairs span two groups).
    Each stage goes to every group before any answer is read."""

    def __init__(self, round_id: bytes, order: list[int], identities: dict[int, Identity], roster: Roster,
                 min_cohort: int, max_colluders: int, workers: Workers | None = None):
        roster = {m.name: m.public for m in roster.by_id.values()}  # the run's, as a worker is sent it
        members = {i: identities[i].private_bytes() for i in order}
        self.workers = workers
        if workers is None:
            self.local = Group(round_id, members, roster, min_cohort, max_colluders)
            self.home = {}
            return
        workers.start()
        size = -(-len(order) // workers.count)
        self.home = {i: w for w in range(workers.count) for i in order[w * size:(w + 1) * size]}
        for w, pipe in enumerate(workers.pipes):
            pipe.send(("start", (round_id, {i: members[i] for i in members if self.home[i] == w}, roster, min_cohort,
                                 max_colluders)))
        self._answers()

    def call(self, stage: str, requests: dict[int, dict]) -> dict:
        if self.workers is None:
            return self.local.call(stage, requests)
        return self._spread(stage, requests, lambda part: part)

    def masked(self, requests: dict[int, tuple[dict, int]], rows: np.ndarray,
               memory: shared_memory.SharedMemory | None) -> dict:
        """Stage 2 on `rows` (in `memory`, shared, where there are workers)."""
        if self.workers is None:
            return self.local.masked(requests, rows)
        return self._spread("masked", requests, lambda part: (part, memory.name, rows.shape))

    def _spread(self, op: str, requests: dict, args) -> dict:
        parts: list[dict] = [{} for _ in self.workers.pipes]
        for i, request in requests.items():
            parts[self.home[i]][i] = request
        for pipe, part in zip(self.workers.pipes, parts):
            pipe.send((op, args(part)))
        out = {}
        for answer in self._answers():
            out.update(answer)
        return out

    def _answers(self) -> list:
        """Every worker's answer to the call just sent (every one read before a failure is raised)."""
        answers = [pipe.recv() for pipe in self.workers.pipes]
        for ok, value in answers:
            if not ok:
                raise value
        return [value for _, value in answers]


def vector_rows(count: int, length: int, shared: bool) -> tuple[np.ndarray, shared_memory.SharedMemory | None]:
    """`count` rows of `length` uint64 for a round's vectors: in shared memory where `shared` and the
    system's shared memory has room for them twice over (else here, and the memory None: the round's
    clients then stay in this process)."""
    size = max(count * length * 8, 8)
    if shared and _room(size):
        memory = shared_memory.SharedMemory(create=True, size=size)
        return np.ndarray((count, length), dtype=np.uint64, buffer=memory.buf), memory
    return np.empty((count, length), dtype=np.uint64), None


def _room(size: int) -> bool:
    try:
        stats = os.statvfs("/dev/shm")
    except OSError:  # no /dev/shm (macOS): its shared memory is not a small file system
        return True
    return stats.f_bavail * stats.f_frsize >= 2 * size


def release(memory: shared_memory.SharedMemory | None) -> None:
    """The round's shared memory closed here and removed (its pages go when the last view does)."""
    if memory is None:
        return
    try:
        memory.close()
    except BufferError:  # a view still held (a round that failed, its traceback kept): freed with it
        pass
    memory.unlink()
