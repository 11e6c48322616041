"""The job configuration: one TOML file read by the workers, the embedded switch and ``deploy``.

Example (``docs/protocol.md`` explains the fields)::

    [switch]
    address = "127.0.0.1:16711"   # where the switch receives (UDP)
    control = "127.0.0.1:16712"   # the embedded switch's control port (status, reset)

    [job]
    id = 1
    key = 0x5eed5eed              # a 32-bit shared secret checked by admission
    slot_base = 0                 # this job's slots on the switch: [base, base + count)
    slot_count = 1024             # optional: wire.default_slot_count(K), 1024 for K = 64
    values_per_packet = 64        # K; 64 is what the P4 program sums
    # loss_recovery = "query"     # "auto" (default), "resend" or "query": see LOSS_RECOVERY
    # generation = 7              # omit to learn it from the switch at start

    [[workers]]                   # rank 0, then rank 1, ...
    address = "10.0.0.1:40000"
    # mac = "02:5a:00:00:00:01"   # the P4 targets: the worker's Ethernet address ...
    # switch_port = 1             # ... and the switch port it hangs off

A switch's job in a tree (``docs/protocol.md`` section 10; :mod:`switchagg.tree` writes these from one
tree file) says where it sits: ``[parent]`` (its parent switch's ``address``, the parent's ``job`` id,
this switch's ``index`` among the parent's children and the parent job's ``key``) and ``[tree]``
(``rank_base``: the tree rank of its first worker; ``size``: the tree's ranks; ``spans``: the ranks
under each child, where the children are switches).

Every key and table is checked: one this module does not know is refused with the nearest known
name (a typo would otherwise leave a default silently in force), and every value is checked for
its type and range before anything uses it.
"""

from __future__ import annotations

import difflib
import ipaddress
import re
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

from .calls import parts
from .errors import ConfigError
from .wire import MAX_TREE_RANKS, MAX_VALUES_PER_PACKET, MAX_WORKERS, P4_VALUES_PER_PACKET, default_slot_count

T = TypeVar("T")

# "auto" asks first from this many workers on: where every worker resends, a lost contribution
# costs all n a resend, (n + 1) / 2 per packet lost with lost results, more than 3 from 6 workers on
QUERY_FROM_WORKERS = 6

# How workers recover a chunk whose result did not come (docs/protocol.md, section 4):
LOSS_RECOVERY = {
    # "resend" for up to QUERY_FROM_WORKERS - 1 workers, "query" from that many on
    "auto": f"resend with up to {QUERY_FROM_WORKERS - 1} workers, ask the switch first with more",
    # every worker resends its contribution at once: the fastest, at (n + 1) / 2 resends per packet lost
    "resend": "every worker resends its contribution",
    # each asks the switch first (a QUERY) and only a worker it misses resends: about one resend per
    # packet lost, for one more round trip per recovery; for large K, or a fabric short of bandwidth
    "query": "workers ask the switch first, and only a worker it misses resends",
}


# The keys of each table of a job file; from_dict refuses any other, naming the nearest of these.
SWITCH_KEYS = ("address", "control")
JOB_KEYS = ("id", "key", "slot_base", "slot_count", "values_per_packet", "loss_recovery", "generation")
WORKER_KEYS = ("address", "mac", "switch_port")
PARENT_KEYS = ("address", "job", "index", "key", "mac", "switch_port")
TREE_KEYS = ("rank_base", "size", "spans")

# Tables a target reads from the job file, beside [switch], [job] and [[workers]], with their keys:
# none today (BMv2 and Tofino take all they need from those three and from the command line). A
# target that wants its own table registers it here; from_dict keeps it in JobConfig.extra.
TARGET_TABLES: dict[str, tuple[str, ...]] = {}

MAX_SWITCH_PORT = 511  # a port id is 9 bits on BMv2 (v1model's egress_spec) and on Tofino (PortId_t)
_MAC = re.compile(r"[0-9a-f]{2}(:[0-9a-f]{2}){5}", re.IGNORECASE)


@dataclass(frozen=True)
class Endpoint:
    """An IPv4 address and UDP port."""

    host: str
    port: int

    @classmethod
    def parse(cls, text: str, what: str) -> Endpoint:
        if not isinstance(text, str):
            raise ConfigError(f"{what} = {text!r}: write it as a string 'IPv4:port', e.g. '127.0.0.1:16711'")
        host, sep, port = text.rpartition(":")
        if not sep or not (port.isascii() and port.isdigit()):
            raise ConfigError(f"{what} = {text!r}: write it as 'IPv4:port', e.g. '127.0.0.1:16711'")
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            raise ConfigError(f"{what} = {text!r}: {host!r} is not an IPv4 address") from None
        if not 0 < int(port) < 65536:
            raise ConfigError(f"{what} = {text!r}: the port must be 1..65535")
        return cls(host, int(port))

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def tuple(self) -> tuple[str, int]:
        return (self.host, self.port)


@dataclass(frozen=True)
class WorkerSpec:
    """One worker (its rank is its position in the list) and where it sends from."""

    address: Endpoint
    mac: str | None = None  # for the P4 target: the worker's Ethernet address
    switch_port: int | None = None  # for the P4 target: the switch port it hangs off


@dataclass(frozen=True)
class ParentSpec:
    """A tree's parent switch of this job (``[parent]``): where its partial sums go, as child ``index`` of
    the parent's job ``job`` under that job's ``key``; for a P4 switch, also the parent's Ethernet
    address and the port it hangs off, as a worker's."""

    address: Endpoint
    job: int
    index: int
    key: int
    mac: str | None = None
    switch_port: int | None = None


@dataclass(frozen=True)
class JobConfig:
    """Everything a worker and a switch must agree on for one job."""

    switch: Endpoint
    job_id: int
    key: int
    slot_base: int
    slot_count: int
    values_per_packet: int
    workers: tuple[WorkerSpec, ...]
    generation: int | None = None
    control: Endpoint | None = None
    loss_recovery: str = "auto"
    extra: dict[str, Any] = field(default_factory=dict, compare=False)
    # its place in a tree (docs/protocol.md section 10): none, the defaults, for a flat job
    parent: ParentSpec | None = None
    rank_base: int = 0
    tree_size: int = 0
    spans: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        """Refuse, naming the field and what to write, anything a worker or a switch could not use."""
        if not isinstance(self.switch, Endpoint):
            raise ConfigError(f"switch.address = {self.switch!r}: give an Endpoint, e.g. Endpoint('127.0.0.1', 16711)")
        if self.control is not None and not isinstance(self.control, Endpoint):
            raise ConfigError(f"switch.control = {self.control!r}: give an Endpoint, or None for no control port")
        _check_range("job.id", self.job_id, 0, 0xFFFF)
        _check_range("job.key", self.key, 0, 0xFFFFFFFF)
        _check_range("job.slot_base", self.slot_base, 0, 0xFFFF)
        _check_range("job.slot_count", self.slot_count, 1, 0xFFFF)
        _check_range("job.values_per_packet", self.values_per_packet, 1, MAX_VALUES_PER_PACKET)
        if self.generation is not None:
            _check_range("job.generation", self.generation, 1, 0xFFFFFFFF)
        if not isinstance(self.loss_recovery, str) or self.loss_recovery not in LOSS_RECOVERY:
            raise ConfigError(f"job.loss_recovery = {self.loss_recovery!r}: use one of "
                              + ", ".join(f'"{name}" ({what})' for name, what in LOSS_RECOVERY.items()))
        if not isinstance(self.workers, tuple):
            raise ConfigError(f"workers = {self.workers!r}: give a tuple of WorkerSpec, one per rank")
        if not 1 <= len(self.workers) <= MAX_WORKERS:
            raise ConfigError(
                f"a job has 1..{MAX_WORKERS} workers, this one lists {len(self.workers)}: "
                "fix the [[workers]] entries")
        seen = {}
        for rank, w in enumerate(self.workers):
            _check_worker(rank, w)
            if w.address in seen:
                raise ConfigError(
                    f"workers {seen[w.address]} and {rank} both use {w.address}: "
                    "give every worker its own address and port")
            seen[w.address] = rank
        self._check_tree()
        # Each call's first packets (the call round) and the join's sums carry two 32-bit words for every
        # rank, in as many chunks of K as they fill, each on a slot of its own (docs/protocol.md, 4 and 6a).
        k, n = self.values_per_packet, self.ranks
        if (chunks := parts(n, k)) > self.slot_count:
            raise ConfigError(
                f"job.slot_count = {self.slot_count} is below the {chunks} chunks of K = {k} values that two "
                f"values per rank take for {n} ranks (each call's first packets carry them, a slot each): "
                f"use slot_count >= {2 * chunks}, or values_per_packet >= {2 * n} and slot_count >= 2")
        # The join climbs rungs of that many slots, each on a block of its own, and a run that climbed closes on
        # block 0: with one block every rung replaces the first's copies, and a rank ahead could strand its
        # peers wherever a run climbs (after one that died inside its join; docs/protocol.md 6a)
        if self.least_slots > self.slot_count:
            raise ConfigError(
                f"job.slot_count = {self.slot_count} holds one block of the {chunks} slot(s) the join's rungs "
                f"take (two values per rank for {n} ranks in chunks of K = {k}), and the join needs two, so that "
                f"a run restarted after one that died inside its join strands no rank: use slot_count >= "
                f"{2 * chunks}" + (f", or values_per_packet >= {2 * n}" if chunks > 1 and self.slot_count >= 2 else ""))

    def _check_tree(self) -> None:
        """A tree's fields in range, and adding up (jobs.check_tree says so again for the switch's entry)."""
        if self.parent is not None:
            if not isinstance(self.parent, ParentSpec) or not isinstance(self.parent.address, Endpoint):
                raise ConfigError(f"parent = {self.parent!r}: give a ParentSpec with an Endpoint address")
            _check_range("parent.job", self.parent.job, 0, 0xFFFF)
            _check_range("parent.index", self.parent.index, 0, MAX_WORKERS - 1)
            _check_range("parent.key", self.parent.key, 0, 0xFFFFFFFF)
            check_link("parent", self.parent.mac, self.parent.switch_port)
        _check_range("tree.rank_base", self.rank_base, 0, MAX_TREE_RANKS - 1)
        _check_range("tree.size", self.tree_size, 0, MAX_TREE_RANKS)
        if not isinstance(self.spans, tuple) or (self.spans and len(self.spans) != len(self.workers)):
            raise ConfigError(f"tree.spans = {self.spans!r}: give the ranks under each of the "
                              f"{len(self.workers)} children, or none (a leaf's children are one rank each)")
        for i, span in enumerate(self.spans):
            _check_range(f"tree.spans[{i}]", span, 1, MAX_TREE_RANKS)
        under = sum(self.spans) if self.spans else len(self.workers)
        if self.rank_base + under > self.ranks:
            raise ConfigError(f"tree.rank_base = {self.rank_base}: its {under} ranks from there do not fit the "
                              f"tree's {self.ranks} (tree.size): fix rank_base or size")

    @property
    def n_workers(self) -> int:
        return len(self.workers)

    @property
    def least_slots(self) -> int:
        """The fewest slots the job runs on: two blocks of the chunks that two words a rank fill, since each
        call's first packets take a block and the join climbs its rungs on blocks of their own (docs/protocol.md
        4 and 6a). A process group's job is never sized below it where the switch's slots are shared."""
        return 2 * parts(self.ranks, self.values_per_packet)

    @property
    def ranks(self) -> int:
        """The ranks of a call: the tree's (``[tree]`` size), or the job's workers."""
        return self.tree_size or (sum(self.spans) if self.spans else len(self.workers))

    def rank_of(self, worker: int) -> int:
        """Worker ``worker``'s rank in a call: its tree rank in a tree, else itself."""
        return self.rank_base + worker

    def with_generation(self, generation: int | None) -> JobConfig:
        return replace(self, generation=generation)

    @classmethod
    def from_file(cls, path: str | Path) -> JobConfig:
        """Read a TOML job file; errors name the file and the field to fix."""
        return build_from(path, read_toml(path, "job file"), cls.from_dict)

    @classmethod
    def from_toml(cls, text: str, what: str = "the job's TOML") -> JobConfig:
        """A job from TOML text, ``what`` naming it in errors (the control port's ``add_job`` reads one so)."""
        return cls.from_dict(parse_toml(text, what))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> JobConfig:
        """A job from a parsed TOML document; refuses unknown tables and keys, naming the nearest known."""
        if not isinstance(data, dict):
            raise ConfigError("a job file holds tables: [switch], [job] and [[workers]]")
        _check_tables(data)
        switch = table_of(data, "switch")
        check_keys(switch, SWITCH_KEYS, "switch")
        job = table_of(data, "job")
        check_keys(job, JOB_KEYS, "job")
        workers = data.get("workers")
        if not isinstance(workers, list) or not workers:
            raise ConfigError("list the workers as [[workers]] tables with an 'address' each")
        for i, w in enumerate(workers):
            if not isinstance(w, dict):
                raise ConfigError(f"workers[{i}] = {w!r}: each worker is a [[workers]] table with an 'address'")
            check_keys(w, WORKER_KEYS, f"workers[{i}]")
        extra = {}
        for name in TARGET_TABLES:
            if name in data:
                extra[name] = table_of(data, name)
                check_keys(extra[name], TARGET_TABLES[name], name)
        parent = tree = None
        if "parent" in data:
            parent = table_of(data, "parent")
            check_keys(parent, PARENT_KEYS, "parent")
        if "tree" in data:
            tree = table_of(data, "tree")
            check_keys(tree, TREE_KEYS, "tree")
        tree = tree or {}
        spans = tree.get("spans", [])
        if not isinstance(spans, list):
            raise ConfigError(f"tree.spans = {spans!r}: write a list of the ranks under each child, e.g. [4, 4]")
        # K first: the default slot count is worked out from it
        k = job.get("values_per_packet", P4_VALUES_PER_PACKET)
        _check_range("job.values_per_packet", k, 1, MAX_VALUES_PER_PACKET)
        return cls(
            switch=Endpoint.parse(get_key(switch, "address", "switch"), "switch.address"),
            control=Endpoint.parse(switch["control"], "switch.control") if "control" in switch else None,
            job_id=get_key(job, "id", "job"),
            key=get_key(job, "key", "job"),
            slot_base=job.get("slot_base", 0),
            slot_count=job.get("slot_count", default_slot_count(k)),
            values_per_packet=k,
            generation=job.get("generation"),
            loss_recovery=job.get("loss_recovery", "auto"),
            workers=tuple(
                WorkerSpec(
                    address=Endpoint.parse(get_key(w, "address", f"workers[{i}]"), f"workers[{i}].address"),
                    mac=w.get("mac"),
                    switch_port=w.get("switch_port"),
                )
                for i, w in enumerate(workers)
            ),
            extra=extra,
            parent=None if parent is None else ParentSpec(
                Endpoint.parse(get_key(parent, "address", "parent"), "parent.address"),
                get_key(parent, "job", "parent"), get_key(parent, "index", "parent"), get_key(parent, "key", "parent"),
                parent.get("mac"), parent.get("switch_port")),
            rank_base=tree.get("rank_base", 0),
            tree_size=tree.get("size", 0),
            spans=tuple(spans),
        )

    @property
    def asks_first(self) -> bool:
        """Whether a worker sends a QUERY before it resends a contribution (``loss_recovery``, with
        ``"auto"`` settled by the number of workers)."""
        if self.loss_recovery == "auto":
            return self.ranks >= QUERY_FROM_WORKERS
        return self.loss_recovery == "query"

    def to_toml(self) -> str:
        """The config as TOML text that :meth:`from_file` reads back unchanged."""
        lines = ["[switch]", f'address = "{self.switch}"']
        if self.control:
            lines.append(f'control = "{self.control}"')
        lines += ["", "[job]", f"id = {self.job_id}", f"key = {self.key:#x}",
                  f"slot_base = {self.slot_base}", f"slot_count = {self.slot_count}",
                  f"values_per_packet = {self.values_per_packet}"]
        if self.generation is not None:
            lines.append(f"generation = {self.generation}")
        if self.loss_recovery != "auto":
            lines.append(f'loss_recovery = "{self.loss_recovery}"')
        for w in self.workers:
            lines += ["", "[[workers]]", f'address = "{w.address}"']
            if w.mac:
                lines.append(f'mac = "{w.mac}"')
            if w.switch_port is not None:
                lines.append(f"switch_port = {w.switch_port}")
        for name, table in self.extra.items():
            lines += ["", f"[{name}]"] + [f"{k} = {_toml_value(v)}" for k, v in table.items()]
        if self.parent is not None:
            p = self.parent
            lines += ["", "[parent]", f'address = "{p.address}"', f"job = {p.job}", f"index = {p.index}",
                      f"key = {p.key:#x}"]
            if p.mac:
                lines.append(f'mac = "{p.mac}"')
            if p.switch_port is not None:
                lines.append(f"switch_port = {p.switch_port}")
        if self.rank_base or self.tree_size or self.spans:
            lines += ["", "[tree]", f"rank_base = {self.rank_base}", f"size = {self.tree_size}"]
            if self.spans:
                lines.append(f"spans = [{', '.join(map(str, self.spans))}]")
        return "\n".join(lines) + "\n"

    def write(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(self.to_toml())
        return path


def read_toml(path: str | Path, kind: str) -> dict[str, Any]:
    """The TOML document in the file at ``path``, read as UTF-8; errors name it (``kind``: "job file") and say
    what to fix."""
    path = Path(path)
    try:
        text = path.read_bytes().decode("utf-8")  # TOML is UTF-8, whatever the locale says
    except FileNotFoundError:
        raise ConfigError(f"{kind} {path} does not exist") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{kind} {path} is not UTF-8 text (byte {exc.start}: {exc.reason}): save it as "
                          "UTF-8, as TOML requires") from None
    except OSError as exc:
        raise ConfigError(f"cannot read {kind} {path}: {exc.strerror or exc}; give a readable file") from None
    return parse_toml(text, f"{kind} {path}")


def build_from(path: str | Path, data: dict[str, Any], build: Callable[[dict[str, Any]], T]) -> T:
    """``build(data)``, a file's document made a config, its errors naming the file."""
    try:
        return build(data)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def parse_toml(text: str, what: str) -> dict[str, Any]:
    """``text`` parsed, ``what`` naming it in errors: every way the text can fail to parse is a ConfigError
    saying what to fix, never the parser's traceback."""
    try:
        data = tomllib.loads(text)
        _check_numbers(data)
        return data
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{what} is not valid TOML: {exc}") from None
    except RecursionError:  # the parser recurses once per level of nesting
        raise ConfigError(f"{what} nests arrays or tables too deep to read: a job file's values are numbers, "
                          "strings and flat tables; remove the nesting") from None
    except ValueError as exc:  # an integer past the digits Python converts (sys.get_int_max_str_digits)
        raise ConfigError(f"{what} holds a number too long to read ({exc}): every number in a job file fits in "
                          "32 bits; shorten it") from None


MAX_NESTING = 16  # levels of arrays and tables a job file's values may nest: its own use two


def _check_numbers(data: dict[str, Any]) -> None:
    """Raise ValueError, as the parser does for a decimal one, at an integer past the digits Python writes
    out: TOML's hex, octal and binary integers are read whole however long, and the message naming the
    field could not then show the value. Raise RecursionError, as the parser does where the interpreter's
    recursion limit stops it, past :data:`MAX_NESTING` levels: a program that raised that limit (importing
    IPython raises it to 3000) would otherwise take nesting that another refuses."""
    todo: list[tuple[Any, int]] = [(data, 0)]
    while todo:
        value, depth = todo.pop()
        if isinstance(value, dict | list) and depth > MAX_NESTING:
            raise RecursionError(f"nested more than {MAX_NESTING} levels")
        if isinstance(value, dict):
            todo.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list):
            todo.extend((v, depth + 1) for v in value)
        elif isinstance(value, int):
            str(value)  # the ValueError that the caller turns into the one-line error


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


def table_of(data: dict[str, Any], name: str) -> dict[str, Any]:
    if name not in data:
        raise ConfigError(f"the [{name}] table is missing")
    table = data[name]
    if not isinstance(table, dict):
        raise ConfigError(f"{name} = {table!r}: [{name}] is a table, write it as a [{name}] header with keys below")
    return table


def _check_tables(data: dict[str, Any]) -> None:
    """Refuse a table this module does not know, naming the nearest known one (or, for a key written
    above every table, the table it belongs in)."""
    tables = ("switch", "job", "workers", "parent", "tree", *TARGET_TABLES)
    homes = {"switch": SWITCH_KEYS, "job": JOB_KEYS, "workers": WORKER_KEYS, "parent": PARENT_KEYS,
             "tree": TREE_KEYS, **TARGET_TABLES}
    for name, value in data.items():
        if name in tables:
            continue
        if not isinstance(value, dict | list):  # a key above the first table header
            home = next((t for t, keys in homes.items() if name in keys), None)
            where = f"move it under {_header(home)}" if home else f"the tables are {', '.join(map(_header, tables))}"
            raise ConfigError(f"{name} = {value!r} stands outside every table: {where}")
        close = difflib.get_close_matches(str(name), tables, n=1)
        hint = f"did you mean {_header(close[0])}?" if close else f"the tables are {', '.join(map(_header, tables))}"
        raise ConfigError(f"[{name}] is not a known table: {hint}")


def _header(table: str) -> str:
    return "[[workers]]" if table == "workers" else f"[{table}]"


def check_keys(table: dict[str, Any], known: tuple[str, ...], where: str) -> None:
    """Refuse a key that is not in ``known``, naming the nearest one: a typo must not leave a default in force."""
    for key in table:
        if key in known:
            continue
        close = difflib.get_close_matches(str(key), known, n=1)
        hint = f"did you mean {close[0]}?" if close else f"the keys there are {', '.join(known)}"
        raise ConfigError(f"{where}.{key} is not a known key: {hint}")


def _check_worker(rank: int, w: WorkerSpec) -> None:
    """A worker's fields: its address an Endpoint, and what the P4 targets need, where given, well formed."""
    if not isinstance(w, WorkerSpec) or not isinstance(w.address, Endpoint):
        raise ConfigError(f"workers[{rank}] = {w!r}: give a WorkerSpec with an Endpoint address")
    check_link(f"workers[{rank}]", w.mac, w.switch_port)


def check_link(where: str, mac: str | None, port: int | None, port_key: str = "switch_port") -> None:
    """What the P4 targets need of a link to a host or a switch, where given, well formed: the Ethernet address
    at its far end (``where``.mac) and the switch port it hangs off (``where``.``port_key``)."""
    if mac is not None:
        if not isinstance(mac, str) or not _MAC.fullmatch(mac):
            raise ConfigError(f"{where}.mac = {mac!r}: write six hex bytes, e.g. \"02:5a:00:00:00:01\"")
        if int(mac[:2], 16) & 1:
            raise ConfigError(f"{where}.mac = {mac!r} is a multicast address: give the device's own "
                              "(unicast) Ethernet address")
    if port is not None:
        _check_range(f"{where}.{port_key}", port, 0, MAX_SWITCH_PORT)


def get_key(table: dict[str, Any], key: str, where: str) -> Any:
    if key not in table:
        raise ConfigError(f"{where}.{key} is missing")
    return table[key]


def _check_range(name: str, value: Any, lo: int, hi: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise ConfigError(f"{name} = {value!r}: it must be an integer in {lo}..{hi}")
