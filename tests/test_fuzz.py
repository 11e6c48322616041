"""The fuzz suite (issue 42): seeded mutated, replayed, forged and random inputs into each surface that takes
what it is sent, for a budget of seconds per surface.

- the C switch against its model: the same datagrams into :class:`NativeSwitch` and :class:`SwitchModel`, the
  same packets out, counters and registers, nothing raised; a job summing real values amid the junk stays exact;
  one job is a leaf of a tree, whose parent's RESULTs (whole, header-only, of a neighbouring chunk, from a
  stranger, mutated) go in too;
- the worker's receive path: junk and mutated results in receive batches to :class:`Reduction` and
  :class:`NativeReduction` in lockstep, the same packets, returns and counts, the foreign ones counted;
- the control port: random and mutated JSON requests to a running :class:`SoftSwitch`, each answered, its
  job intact and the switch serving;
- the config parser: mutated TOML texts and bytes, each a :class:`ConfigError` or a valid config.

The inputs follow from ``SWITCHAGG_FUZZ_SEED`` (default 42): a failure names it and the input's number, and
the same seed gives the same inputs in the same order; ``SWITCHAGG_FUZZ_SECONDS`` (default 2) is how long
each surface runs, so only how far into that sequence a run gets depends on the machine. ``make fuzz`` runs
a minute a surface and prints each surface's figures (inputs, kinds, crashes, wrong sums, hangs).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import os
import random
import socket
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from switchagg import ConfigError, JobConfig, SoftSwitch
from switchagg.jobs import JobEntry, Uplink
from switchagg.loopback import loopback_job
from switchagg.payloads import Int32Payloads
from switchagg.protocol import NativeReduction, Reduction, StreamParams
from switchagg.switch.control import Guard, serve
from switchagg.switch.model import SwitchModel
from switchagg.switch.native import NativeSwitch
from switchagg.transport import sockaddr_in
from switchagg.window import Window
from switchagg.wire import (
    FIELDS,
    FLAG_OWNER,
    HEADER_SIZE,
    MAX_WORKERS,
    PacketType,
    datagram_size,
    make_header,
    unpack_header,
)

from .test_switch_model import Out, batch_of

SEED = int(os.environ.get("SWITCHAGG_FUZZ_SEED", "42"))
SECONDS = float(os.environ.get("SWITCHAGG_FUZZ_SECONDS", "2"))
REPLY_TIMEOUT = 30.0  # seconds the control port may take to answer one request before it counts as a hang

# each header field's (offset, size) in bytes, from the one definition of the format
_SIZES = [f.bits // 8 for f in FIELDS]
OFFSETS = {f.name: (end - size, size) for f, size, end in zip(FIELDS, _SIZES, itertools.accumulate(_SIZES),
                                                                strict=True)}


@dataclass
class Figures:
    """What a surface's run tried and found; the first failure keeps the input that made it."""

    surface: str
    inputs: int = 0
    kinds: collections.Counter = field(default_factory=collections.Counter)
    crashes: int = 0
    mismatches: int = 0  # where the twins disagree
    wrong_sums: int = 0
    hangs: int = 0
    first: str | None = None

    def fail(self, what: str, detail: str) -> None:
        setattr(self, what, getattr(self, what) + 1)
        if self.first is None:
            self.first = f"{what} at input {self.inputs} (SWITCHAGG_FUZZ_SEED={SEED}): {detail}"

    def report(self) -> None:
        """Print the figures (``make fuzz`` shows them) and fail with the first failure's input and seed."""
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(self.kinds.items()))
        print(f"\nfuzz {self.surface}: seed {SEED}, {self.inputs} inputs ({kinds}); crashes {self.crashes}, "
              f"mismatches {self.mismatches}, wrong sums {self.wrong_sums}, hangs {self.hangs}")
        assert self.first is None, self.first


def budget(seconds: float = SECONDS) -> Iterator[int]:
    """Input numbers until the surface's seconds are spent (at least one input)."""
    end = time.monotonic() + seconds
    i = 0
    while i == 0 or time.monotonic() < end:
        yield i
        i += 1


def mutate(rng: random.Random, data: bytes, others: list[bytes]) -> tuple[str, bytes]:
    """One mutation of a valid datagram: which kind, and the bytes."""
    kind = rng.choice(("bitflip", "truncate", "extend", "field", "swap"))
    b = bytearray(data)
    if kind == "bitflip" and b:
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
    elif kind == "truncate":
        del b[rng.randrange(len(b) + 1):]
    elif kind == "extend":
        b += rng.randbytes(rng.choice((1, 3, 4, 8, rng.randrange(1, 600))))
    elif kind == "field" and len(b) >= HEADER_SIZE:  # a header field set to an edge or a random value
        at, size = OFFSETS[rng.choice(list(OFFSETS))]
        value = rng.choice((0, 1, (1 << 8 * size) - 1, 1 << (8 * size - 1), rng.getrandbits(8 * size)))
        b[at:at + size] = value.to_bytes(size, "big")
    elif kind == "swap" and len(b) >= HEADER_SIZE and others:  # a field taken from another valid packet
        other = rng.choice(others)
        at, size = OFFSETS[rng.choice(list(OFFSETS))]
        if len(other) >= at + size:
            b[at:at + size] = other[at:at + size]
    return kind, bytes(b)


def random_datagram(rng: random.Random) -> bytes:
    return rng.randbytes(rng.choice((0, 1, HEADER_SIZE - 1, HEADER_SIZE, HEADER_SIZE + 4, rng.randrange(400))))


def forged_header(rng: random.Random, job: int, worker: int) -> bytes:
    """A well-formed header of any type with random fields (a job's ids now and then), and count values."""
    count = rng.choice((0, 1, 4, 6, 8, rng.randrange(64)))
    h = make_header(PacketType(rng.randint(1, 6)), job=job if rng.random() < 0.5 else rng.getrandbits(16),
                    worker=worker if rng.random() < 0.5 else rng.getrandbits(5), slot=rng.randrange(8),
                    copy=rng.randrange(2), chunk=rng.getrandbits(32), generation=rng.getrandbits(32),
                    key=rng.getrandbits(32), exponent=rng.randint(-128, 127), count=count)
    return h.pack() + rng.randbytes(4 * count)


# ---- the C switch against the model ------------------------------------------------------------------


@dataclass
class FuzzJob:
    """A job both switches hold, and what its workers are on."""

    entry: JobEntry
    chunk: int = 0

    def contribution(self, rng: random.Random, worker: int, chunk: int, values: np.ndarray | None = None) -> bytes:
        """``worker``'s contribution to ``chunk`` on the slot and copy its workers use (random values unless
        given)."""
        e = self.entry
        values = rng_values(rng, e.values_per_packet) if values is None else values
        h = make_header(PacketType.CONTRIB, job=e.job_id, worker=worker, slot=chunk % e.slot_count,
                        copy=chunk // e.slot_count % 2, chunk=chunk, generation=e.generation, key=e.key,
                        exponent=rng.randint(-128, 127), count=len(values))
        return h.pack() + values.astype(">i4").tobytes()

    def from_parent(self, rng: random.Random, chunk: int) -> bytes:
        """The parent's RESULT for ``chunk`` of this job, a level of a tree: its K values, or its header alone
        with an owner (mostly under another leaf), now and then without one."""
        e, up = self.entry, self.entry.parent
        whole = rng.random() < 0.7
        values = rng_values(rng, e.values_per_packet) if whole else np.zeros(0, np.int64)
        owned = not whole or rng.random() < 0.3
        h = make_header(PacketType.RESULT, job=up.job_id, worker=up.worker, slot=chunk % e.slot_count,
                        copy=chunk // e.slot_count % 2, chunk=chunk, generation=e.generation, key=up.key,
                        exponent=rng.randint(-128, 127), count=len(values))
        if owned and rng.random() < 0.95:
            h = h._replace(flags=h.flags | FLAG_OWNER, owner=rng.randrange(e.tree_ranks + 2))
        return h.pack() + values.astype(">i4").tobytes()


def rng_values(rng: random.Random, k: int) -> np.ndarray:
    return np.frombuffer(rng.randbytes(4 * k), ">i4").astype(np.int64)


PARENT = Uplink(("10.0.99.1", 16711), 70, 1, 0xFACE)  # job 7's: a leaf of a tree, tree ranks 2..6 of 9


def switch_jobs() -> list[JobEntry]:
    """Two jobs for junk and control changes, job 7 a leaf of a tree (docs/protocol.md section 10) whose parent
    sends RESULTs, and job 3 (2 workers, K 8) that sums real values."""
    def workers(job: int, n: int) -> tuple[tuple[str, int], ...]:
        return tuple((f"10.0.{job}.{i + 1}", 5000 + i) for i in range(n))
    return [JobEntry(1, 5, 0x5EED, 0, 2, 4, workers(1, 3)),
            JobEntry(7, 6, 0xBEEF, 2, 3, 6, workers(7, 5), PARENT, (), 2, 9),
            JobEntry(3, 11, 0xC0FFEE, 6, 2, 8, workers(3, 2))]


def same_state(ref: SwitchModel, native: NativeSwitch) -> str | None:
    """Where the twins' counters or registers differ (the comparison of tests/test_switch_model.py), or None."""
    if native.counters() != ref.counters():
        return f"counters: C {native.counters()} model {ref.counters()}"
    for i in range(2 * ref.num_slots):
        if native.registers(i) != ref.registers(i):
            return f"register {i}: C {native.registers(i)} model {ref.registers(i)}"
    return None


def test_the_c_switch_and_the_model_agree_on_junk_and_sums_stay_exact() -> None:
    """Datagrams go in rounds of up to 32: the model takes each alone, the C switch the round as one receive
    batch (``process_batch``, as the server's socket hands it over) or one at a time (``process``); the
    packets out must be the same, in the same order, and so the counters and registers, checked every few
    hundred rounds. Between rounds the control plane resets a job or re-adds it with another K."""
    rng = random.Random(SEED)
    figures = Figures("C switch vs model")
    ref, native = SwitchModel(8), NativeSwitch(8)
    jobs = {e.job_id: FuzzJob(e) for e in switch_jobs()}
    for e in switch_jobs():
        ref.add_job(e)
        native.add_job(e)
    valid: list[bytes] = []  # recent valid packets: what mutations start from
    old_session: list[bytes] = []  # packets of a generation since replaced: replays of an earlier session
    summing = jobs[3]
    sums: dict[int, np.ndarray] = {}  # job 3's chunk -> its exact sum (int32 wrap-around)

    def run(round_: list[tuple[bytes, tuple[str, int], str]]) -> bool:
        """One round into both; False once they disagree (their states differ from there on)."""
        figures.inputs += len(round_)
        shown = [(kind, data.hex(), source) for data, source, kind in round_]
        try:
            want = [(sockaddr_in(e.dst), e.payload()) for data, source, _ in round_ for e in ref.process(data, source)]
            if rng.random() < 0.5:
                figures.kinds["rounds batched"] += 1
                got = batched(native, [(data, source) for data, source, _ in round_])
            else:
                got = [(sockaddr_in(e.dst), e.payload()) for data, source, _ in round_
                       for e in native.process(data, source)]
        except Exception:  # noqa: BLE001 - a crash is a finding, reported with its input
            figures.fail("crashes", f"round {shown}:\n{traceback.format_exc()}")
            return False
        if got != want:
            figures.fail("mismatches", f"round {shown}: C sent {got}, the model {want}")
            return False
        workers = {sockaddr_in(w) for w in summing.entry.workers}
        for dst, payload in want:
            h = unpack_header(payload)
            if h.type == PacketType.RESULT and h.job == 7:
                figures.kinds["leaf's results"] += 1  # down from its parent's, or answered from one it took
            if h.type == PacketType.RESULT and h.job == 3 and h.generation == summing.entry.generation \
                    and dst in workers:
                figures.kinds["sums checked"] += 1
                values = np.frombuffer(payload[HEADER_SIZE:], ">i4")
                if h.chunk not in sums or not np.array_equal(values, sums[h.chunk]):
                    figures.fail("wrong_sums", f"job 3 chunk {h.chunk}: {values} for {sums.get(h.chunk)} in "
                                               f"round {shown}")
        return True

    round_: list[tuple[bytes, tuple[str, int], str]] = []
    rounds = 0
    for _ in budget():
        roll = rng.random()
        if roll < 0.05:  # job 3's next chunk: every worker's contribution and a resend of each, amid the junk
            chunk = summing.chunk
            summing.chunk += 1
            parts = [rng_values(rng, 8) for _ in summing.entry.workers]
            sums[chunk] = (np.sum(parts, axis=0) + 2**31) % 2**32 - 2**31
            for w, values in enumerate(parts):
                data = summing.contribution(rng, w, chunk, values)
                valid.append(data)
                figures.kinds["summed"] += 2
                for _ in range(2):
                    round_.insert(rng.randrange(len(round_) + 1), (data, summing.entry.workers[w], "summed"))
            continue
        j = jobs[rng.choice((1, 7))]
        worker = rng.randrange(j.entry.n_workers)
        source = j.entry.workers[worker]
        if roll < 0.1:  # job 7's parent: a RESULT for its chunk (or the one before), now and then from a stranger
            j = jobs[7]
            kind, data = "from parent", j.from_parent(rng, (j.chunk - (rng.random() < 0.2)) & 0xFFFFFFFF)
            source = PARENT.address if rng.random() < 0.9 else ("10.9.9.9", 16711)
            valid.append(data)
        elif roll < 0.3:
            if rng.random() < 0.1:
                j.chunk += 1
            kind, data = "valid", j.contribution(rng, worker, (j.chunk - (rng.random() < 0.1)) & 0xFFFFFFFF)
            valid.append(data)
        elif roll < 0.65 and valid:
            kind, data = mutate(rng, rng.choice(valid[-200:]), valid[-50:])
            source = rng.choice((source, summing.entry.workers[0], ("10.9.9.9", 4000)))
            data = unforged(data, source, summing.entry)
        elif roll < 0.75 and old_session:
            kind, data = "replay", rng.choice(old_session)
        elif roll < 0.87:
            kind, data = "forged", forged_header(rng, j.entry.job_id, worker)
            source = rng.choice((source, summing.entry.workers[1]))
            data = unforged(data, source, summing.entry)
        else:
            kind, data = "random", random_datagram(rng)
        figures.kinds[kind] += 1
        round_.append((data, source, kind))
        if len(round_) < rng.choice((1, 8, 32)):
            continue
        if not run(round_):
            break
        round_ = []
        rounds += 1
        del valid[:-400]
        if rounds % 256 == 0 and (diff := same_state(ref, native)):
            figures.fail("mismatches", diff)
            break
        if rng.random() < 0.02:  # the control plane between rounds: a reset, or the job re-added with another K
            figures.kinds["control"] += 1
            old_session = valid[-100:]
            reset = rng.random() < 0.5
            if reset:  # a new generation: the old one's packets are an earlier session's
                j.entry = dataclasses.replace(j.entry, generation=j.entry.generation % 0xFFFFFFFF + 1)
            else:  # its generation kept, as an operator redeploys, and its slots cleared
                j.entry = dataclasses.replace(j.entry, values_per_packet=rng.choice((4, 5, 6)))
            for sw in (ref, native):
                if reset:
                    sw.set_generation(j.entry.job_id, j.entry.generation)
                else:
                    sw.remove_job(j.entry.job_id)
                    sw.add_job(j.entry)
    else:
        if run(round_) and (diff := same_state(ref, native)):
            figures.fail("mismatches", diff)
    figures.report()
    assert figures.kinds["sums checked"] or not figures.kinds["summed"]
    assert figures.kinds["leaf's results"] or figures.kinds["from parent"] < 100  # the tree's down path ran


def batched(native: NativeSwitch, traffic: list[tuple[bytes, tuple[str, int]]]) -> list[tuple[bytes, bytes]]:
    """What the C switch sends for ``traffic`` taken as one receive batch (tests/test_switch_model.py's
    arrays), with out arrays that hold a few multicasts, so that it stops and resumes mid-batch."""
    batch = batch_of(traffic)
    room = MAX_WORKERS * max([HEADER_SIZE, *(len(data) for data, _ in traffic)])  # a round may be empty
    out = Out(2 * MAX_WORKERS, 2 * room)
    got, start = [], 0
    while start < len(traffic):
        start, made = native.process_batch(*batch, start, len(traffic), *out.arrays())
        got += out.packets(made)
    return got


def unforged(data: bytes, source: tuple[str, int], summing: JobEntry) -> bytes:
    """``data``, unless it is a contribution to the summing job that the switch must take (its job, key and
    generation, from one of its workers' addresses): that is a forgery with the key, which nothing can tell
    from the worker's own, so its key is changed (junk is what a key keeps out)."""
    if len(data) >= HEADER_SIZE and source in summing.workers:
        h = unpack_header(data)
        if (h.job, h.key, h.generation) == (summing.job_id, summing.key, summing.generation):
            at, size = OFFSETS["key"]
            return data[:at] + (h.key ^ 1).to_bytes(size, "big") + data[at + size:]
    return data


# ---- the worker's receive path -----------------------------------------------------------------------


def foreign_to(data: bytes, params: StreamParams) -> bool:
    """Whether a worker must count ``data`` foreign (docs/protocol.md): too short, another type, lengths that
    disagree, or another job's, worker's, session's or key's result or answer."""
    if len(data) < HEADER_SIZE:
        return True
    h = unpack_header(data)
    if h.type == PacketType.RESULT and len(data) == HEADER_SIZE + 4 * h.count:
        return (h.job, h.worker, h.generation, h.key) != (params.job, params.worker, params.generation, params.key)
    if h.type == PacketType.PENDING and len(data) == HEADER_SIZE:
        return (h.job, h.worker, h.generation, h.count) != (params.job, params.worker, params.generation, 0)
    return True


def test_the_workers_receive_path_takes_junk_alike_in_both_twins_and_counts_it() -> None:
    """Calls of 1 to 3 workers, each rank a Python and a C stream in lockstep: their packets sum on a model,
    lost now and then, and each receive batch holds the rank's results amid junk. A session is "junk" (what
    reaches a worker is foreign by the protocol's rules: counted, its sums exact) or "forged" (mutations that
    keep the run's identity too, which only the twins' agreement can hold)."""
    rng = random.Random(SEED + 1)
    figures = Figures("worker receive path")
    earlier: list[bytes] = []  # results of earlier sessions: replays
    session = 0
    for _ in budget():
        session += 1
        forge = rng.random() < 0.3
        n, k, slots, n_chunks = rng.randint(1, 3), 8, 4, rng.randint(1, 12)
        key, generation = rng.getrandbits(32), session
        entry = JobEntry(1, generation, key, 0, slots, k, tuple((f"10.0.0.{r + 1}", 6000 + r) for r in range(n)))
        model = SwitchModel(slots)
        model.add_job(entry)
        params = [StreamParams(1, r, key, generation, n, slots, k, rng.random() < 0.3) for r in range(n)]
        size, first = k * n_chunks - rng.randrange(k), rng.getrandbits(32)
        xs = [np.frombuffer(rng.randbytes(4 * size), np.int32) for _ in range(n)]
        want = np.sum(np.stack(xs).astype(np.int64), axis=0).astype(np.int32)  # int32 wraps, as the switch sums
        twins, outs = [], [[np.zeros_like(x) for x in xs] for _ in range(2)]
        for t, cls in enumerate((Reduction, NativeReduction)):
            twins.append([cls(params[r], Window(slots, initial=2), Int32Payloads(xs[r], outs[t][r], k),
                              n_chunks=n_chunks, first_id=first, copies=np.zeros(slots, np.int64), now=0.0,
                              progress_timeout=1e9, started=False)
                          for r in range(n)])
        junk_sent = [0] * n
        results: list[list[bytes]] = [[] for _ in range(n)]
        now, steps, failed = 0.0, 0, False
        while not all(red.done for red in twins[0]) and not failed:
            steps += 1
            if steps > 5000:
                figures.fail("hangs", f"session {session}: not done after 5000 steps")
                break
            now += rng.choice((0.0005, 0.002, 0.05, 0.5))
            for r in range(n):
                sent = []
                for reds in twins:
                    reds[r].tick(now)  # the progress timeout is past any session's end: nothing to raise
                    rows, lengths = np.zeros((16, datagram_size(k)), np.uint8), np.zeros(16, np.uint32)
                    out = []
                    while m := reds[r].emit(rows, lengths):
                        out += [rows[i, :lengths[i]].tobytes() for i in range(m)]
                    sent.append(out)
                if sent[0] != sent[1]:
                    figures.fail("mismatches", f"session {session} rank {r} step {steps}: the twins sent "
                                               f"{len(sent[0])} and {len(sent[1])} packets, or other bytes")
                    failed = True
                    break
                for data in sent[0]:
                    if rng.random() < 0.15:
                        continue  # lost on the way up
                    for e in model.process(data, entry.workers[r]):
                        if rng.random() > 0.1:  # or down
                            results[entry.workers.index(e.dst)].append(e.payload())
            for r in range(n):
                if failed:
                    break
                batch, mine = [], results[r]
                results[r] = []
                for _ in range(rng.choice((0, 0, 1, 3, 8))):
                    figures.inputs += 1
                    kind, data = worker_junk(rng, mine or earlier[-50:] or [b""], earlier, params[r], results)
                    if not forge and not foreign_to(data, params[r]):
                        continue
                    figures.kinds[kind] += 1
                    junk_sent[r] += 1
                    batch.append(data)
                figures.inputs += len(mine)
                figures.kinds["results"] += len(mine)
                batch += mine
                rng.shuffle(batch)
                earlier += mine
                offsets = np.cumsum([0] + [len(d) for d in batch[:-1]], dtype=np.uint32)
                lengths = np.array([len(d) for d in batch], np.uint32)
                got = []
                for reds in twins:
                    try:
                        got.append(reds[r].receive_batch(b"".join(batch), offsets, lengths, now))
                    except Exception:  # noqa: BLE001 - a crash is a finding, reported with its batch
                        figures.fail("crashes", f"session {session} rank {r}: {type(reds[r]).__name__} raised on "
                                                f"{[d.hex() for d in batch]}:\n{traceback.format_exc()}")
                        failed = True
                        break
                if failed:
                    break
                state = [(g, reds[r].foreign, reds[r].protocol_errors, reds[r].retransmissions, reds[r].done)
                         for g, reds in zip(got, twins, strict=True)]
                if state[0] != state[1]:
                    figures.fail("mismatches", f"session {session} rank {r}: Python (new, foreign, protocol errors, "
                                               f"resent, done) {state[0]}, C {state[1]}, after "
                                               f"{[d.hex() for d in batch]}")
                    failed = True
        del earlier[:-400]
        figures.kinds["sessions forged" if forge else "sessions junk"] += 1
        if failed or not all(red.done for red in twins[0]):
            continue
        for r in range(n):
            py, c = twins[0][r], twins[1][r]
            if not np.array_equal(outs[0][r], outs[1][r]):
                figures.fail("mismatches", f"session {session} rank {r}: the twins summed {outs[0][r]} and "
                                           f"{outs[1][r]}")
            elif not forge and not np.array_equal(outs[0][r], want):
                figures.fail("wrong_sums", f"session {session} rank {r}: {outs[0][r]} for {want}")
            if py.window.state() != c.window.state():
                figures.fail("mismatches", f"session {session} rank {r}: the twins' windows end "
                                           f"{py.window.state()} and {c.window.state()}")
            if not forge and (py.foreign, c.foreign) != (junk_sent[r], junk_sent[r]):
                figures.fail("mismatches", f"session {session} rank {r}: {junk_sent[r]} foreign datagrams sent, "
                                           f"Python counted {py.foreign}, C {c.foreign}")
    figures.report()


def worker_junk(rng: random.Random, mine: list[bytes], earlier: list[bytes], params: StreamParams,
                others: list[list[bytes]]) -> tuple[str, bytes]:
    """One datagram that is not simply the rank's next result: a mutation of one of its results, another
    rank's result, an earlier session's, a forged header, or random bytes."""
    roll = rng.random()
    if roll < 0.5:
        return mutate(rng, rng.choice(mine), mine)
    if roll < 0.6 and any(others):
        return "another rank's", rng.choice([d for o in others for d in o])
    if roll < 0.75 and earlier:
        return "replay", rng.choice(earlier)
    if roll < 0.9:
        return "forged", forged_header(rng, params.job, params.worker)
    return "random", random_datagram(rng)



# ---- the control port --------------------------------------------------------------------------------


def json_value(rng: random.Random, depth: int = 0) -> object:
    """A random JSON value: huge and edge integers, floats, strings, and arrays and objects."""
    roll = rng.random()
    if roll < 0.25:
        return rng.choice((0, -1, 1, 2**31, 2**32 - 1, 2**32, 2**64, -(2**63), 10**rng.randint(1, 4000),
                           rng.getrandbits(32)))
    if roll < 0.35:
        return rng.choice((0.5, -0.0, 1e308, True, False, None))
    if roll < 0.6:
        return rng.choice(("", "status", "add_job", "\x00", "\ud7ff" * 3, "x" * rng.randrange(3000),
                           rng.randbytes(8).hex()))
    if roll < 0.8 and depth < 3:
        return [json_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    if depth < 3:
        return {rng.choice(("op", "job", "key", "slots", "config", "token", "x")): json_value(rng, depth + 1)
                for _ in range(rng.randrange(4))}
    return rng.getrandbits(16)


def control_request(rng: random.Random, config: JobConfig, configs: list[str]) -> tuple[str, bytes]:
    """One request line (no newline): a random one, a well-formed op with wrong fields, or a mutated valid one."""
    ops = ("status", "slots", "add_job", "reset", "remove_job", "Status", "", "shutdown")
    roll = rng.random()
    if roll < 0.3:
        req = {"op": rng.choice(ops)}
        for name in rng.sample(("job", "key", "slots", "config", "token", "extra"), rng.randrange(4)):
            req[name] = json_value(rng)
        if rng.random() < 0.3:
            req["job"] = config.job_id  # its job, with a wrong key or none: never the right one
            req["key"] = config.key ^ rng.randrange(1, 2**32) if rng.random() < 0.8 else str(config.key)
        if req["op"] == "add_job" and rng.random() < 0.5:
            req["config"] = rng.choice(configs)
        kind, line = "op", json.dumps(req).encode()
    elif roll < 0.47:
        kind, line = "random json", json.dumps(json_value(rng)).encode()
    elif roll < 0.5:  # nested far past what a parser recurses through
        depth = rng.choice((100, 1000, 100_000))
        kind, line = "deep", b'{"op": "slots", "slots": ' + b"[" * depth + b"1" + b"]" * depth + b"}"
    elif roll < 0.52:  # past the digits Python converts
        kind, line = "huge int", b'{"op": "reset", "job": 1, "key": ' + b"9" * rng.choice((4301, 100_000)) + b"}"
    elif roll < 0.8:
        valid = rng.choice(({"op": "status"}, {"op": "slots", "job": config.job_id, "slots": [0, 1]},
                            {"op": "add_job", "config": rng.choice(configs)},
                            {"op": "reset", "job": config.job_id, "key": config.key ^ 1}))
        kind, line = mutate(rng, json.dumps(valid).encode(), [])
        kind = f"mutated {kind}"
    else:
        kind, line = "random bytes", rng.randbytes(rng.randrange(200))
    if b"\n" in line and rng.random() < 0.5:
        line = line.replace(b"\n", b" ")
    return kind, line.replace(b"\n", b"")


def test_the_control_port_answers_every_request_and_keeps_its_job() -> None:
    """Requests to a running switch, most through ``serve`` (the port's dispatch, in this thread), every tenth on
    the socket: each gets one JSON object back, "error" or a result; the port's job is never changed (no request
    carries its key) and the switch still answers a probe and status at the end."""
    rng = random.Random(SEED + 2)
    figures = Figures("control port")
    with SoftSwitch(("127.0.0.1", 0), control=("127.0.0.1", 0)) as sw:
        config = loopback_job(2, values_per_packet=64, slot_count=4, switch_port=sw.address[1],
                              control_port=sw.control_address[1])
        sw.add_job(config)
        entry = sw.jobs()[config.job_id]
        configs = [loopback_job(1, values_per_packet=8, slot_count=2, slot_base=8 + 2 * i, job_id=100 + i).to_toml()
                   for i in range(3)]
        # the port as it runs without a control token, and as an operator's token makes it: add_job refused
        # unless the request carries it (never here), wrong keys and tokens counted and rate-limited per address
        guards = (Guard(), Guard("fuzz-token"))
        with socket.create_connection(sw.control_address, timeout=REPLY_TIMEOUT) as conn:
            replies = conn.makefile("rb")
            for i in budget():
                figures.inputs = i
                kind, line = control_request(rng, config, configs)
                figures.kinds[kind] += 1
                try:
                    if i % 10 == 0:
                        figures.kinds["on the socket"] += 1
                        conn.sendall(line + b"\n")
                        reply = json.loads(replies.readline())
                    else:
                        reply = serve(sw, line + b"\n", guards[i % 2], f"127.0.0.{i % 7 + 1}")
                except TimeoutError:
                    figures.fail("hangs", f"no reply in {REPLY_TIMEOUT} s to {line[:300]!r}")
                    break
                except Exception:  # noqa: BLE001 - a crash is a finding, reported with its request
                    figures.fail("crashes", f"{line[:300]!r}:\n{traceback.format_exc()}")
                    break
                if not isinstance(reply, dict) or not reply.keys() <= {"error", "generation", "slots", "address",
                                                                         "backend", "cores", "num_slots", "jobs",
                                                                         "counters", "shards", "sockets", "control",
                                                                         "leases", "lease"}:
                    figures.fail("crashes", f"{line[:300]!r} got {str(reply)[:300]}")
                figures.kinds["error replies" if "error" in reply else "results"] += 1
                if i % 2 and "generation" in reply and json.loads(line).get("op") == "add_job":
                    figures.fail("mismatches", f"{line[:300]!r} installed a job without the control token")
                if sw.jobs().get(config.job_id) != entry:
                    figures.fail("mismatches", f"{line[:300]!r} changed the job: {sw.jobs().get(config.job_id)}")
                    break
                for job_id in set(sw.jobs()) - {config.job_id}:  # what a mutated add_job installed: freed again
                    sw.remove_job(job_id)
        probe = make_header(PacketType.PROBE, job=config.job_id, worker=0, key=config.key).pack()
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as rank0:
            rank0.bind(config.workers[0].address.tuple)
            rank0.settimeout(REPLY_TIMEOUT)
            rank0.sendto(probe, sw.address)
            assert unpack_header(rank0.recv(100)).type == PacketType.PROBE_REPLY
        assert sw.error is None
    figures.report()


# ---- the config parser -------------------------------------------------------------------------------

TOML_VALUES = ('0', '-1', '4294967296', '1' * 5000, '0x5eed', '1e999', 'nan', 'inf', 'true', '"x"', '""',
               '"\\u0000"', '"127.0.0.1:99999"', '"::1:5"', '[]', '[1, "a"]', '{}', '{ a = 1 }',
               '[' * 1000 + ']' * 1000, '1979-05-27T07:32:00Z', "'''a'''", '"\\uD800"')


def mutated_toml(rng: random.Random, good: str) -> tuple[str, str]:
    """A job file's text changed: a value replaced, a line dropped or repeated, lines swapped, a table renamed,
    or the text's characters mutated."""
    lines = good.splitlines() or [""]
    kind = rng.choice(("value", "drop line", "repeat line", "swap lines", "table", "chars", "splice"))
    i, j = rng.randrange(len(lines)), rng.randrange(len(lines))
    if kind == "value" and "=" in lines[i]:
        lines[i] = lines[i].split("=")[0] + "= " + rng.choice(TOML_VALUES)
    elif kind == "drop line":
        del lines[i]
    elif kind == "repeat line":
        lines.insert(j, lines[i])
    elif kind == "swap lines":
        lines[i], lines[j] = lines[j], lines[i]
    elif kind == "table":
        lines.insert(i, rng.choice(("[switch]", "[job]", "[[workers]]", "[[job]]", "[workers]", "[x.y]", "[")))
    elif kind == "splice":
        lines[i] = lines[i][:rng.randrange(len(lines[i]) + 1)] + rng.choice(TOML_VALUES)
    else:
        _, data = mutate(rng, "\n".join(lines).encode(), [])
        return kind, data.decode("utf-8", "replace")
    return kind, "\n".join(lines)


def test_the_config_parser_refuses_mutated_files_with_a_config_error(tmp_path) -> None:
    """Texts to ``from_toml`` and bytes (not UTF-8 now and then) to ``from_file``: a valid config or a
    :class:`ConfigError`, never another exception; one that parses writes back to itself."""
    rng = random.Random(SEED + 3)
    figures = Figures("config parser")
    goods = [loopback_job(n, values_per_packet=k, job_id=n).with_generation(g).to_toml()
             for n, k, g in ((1, 64, None), (3, 8, 5), (2, 8192, 77))]
    path = tmp_path / "job.toml"
    for i in budget():
        figures.inputs = i
        text = rng.choice(goods)
        for _ in range(rng.choice((1, 1, 2, 4))):
            kind, text = mutated_toml(rng, text)
            figures.kinds[kind] += 1
        as_bytes = rng.random() < 0.3
        if as_bytes:
            figures.kinds["file bytes"] += 1
            path.write_bytes(mutate(rng, text.encode(), [])[1] if rng.random() < 0.5 else text.encode())
        try:
            cfg = JobConfig.from_file(path) if as_bytes else JobConfig.from_toml(text)
        except ConfigError:
            figures.kinds["refused"] += 1
            continue
        except Exception:  # noqa: BLE001 - a crash is a finding, reported with its text
            figures.fail("crashes", f"{text[:2000]!r}:\n{traceback.format_exc()}")
            continue
        figures.kinds["valid"] += 1
        if JobConfig.from_toml(cfg.to_toml()) != cfg:
            figures.fail("mismatches", f"{text[:2000]!r} does not write back to itself")
    figures.report()
