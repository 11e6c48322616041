"""P4Testgen's tests of ``p4/tna``, read without running PTF, and held to :class:`SwitchModel`.

P4Testgen (p4c's ``backends/p4tools``, module testgen, Tofino target) executes the TNA program
symbolically under its own model of the chip and writes, per path, a PTF test: the table entries
and register values the path needs, the packet sent and the packets expected (or none: a drop).
This module runs it (:func:`generate`), takes each test apart with :mod:`ast` (:func:`parse_ptf`:
nothing of PTF or BfRt is imported or run), turns its admission entry into the job the control
plane would have installed and its registers into the model's copy state (:func:`translate`), and
works out from :meth:`SwitchModel.process_frame` what the Tofino program must do with the packet
(:func:`tofino_expectation`): the packet it sends and the counters it bumps. :func:`compare` holds
P4Testgen's expectation to that, and every test that cannot be compared is classified with its
reason instead of being skipped. ``docs/tofino.md`` ("What P4Testgen checks") says what is
covered.

Both passes are compared. P4Testgen runs one pass at a time: a test sent in on the recirculation port
is a second pass, its packet the contribution as the first pass recirculated it (hdr.recirc in front),
its registers the second half's; :func:`_translate_second_pass` says how that becomes the model's
state and the worker's contribution.

Four things are P4Testgen's and not the program's, and are handled here, each said where it is:

* the admission entry, the registers and a recirculated packet P4Testgen makes up are any bits at
  all; a copy of the program with ``testgen_assume`` lines in it (:func:`prepare_program`) keeps
  them to entries, states and packets a control plane and earlier packets can produce;
* its parser value sets stay empty, so the copy matches the recirculation port as a constant;
* it has no packet replication engine: a multicast is dropped, and only what ingress did with it
  (group, headers, counters) is compared;
* its checksum extern is not modelled (a reply's IPv4 checksum is taint), and its egress reads the
  17-bit ``@flexible`` bridge header without the padding bf-p4c gives it, so every expected packet
  lacks its first byte and most are masked: the fields are also taken from the trace of what the
  ingress deparser emitted (:func:`ingress_emits`), which is P4Testgen's own, fully computed; counters
  are no-ops in its model: which counter a packet bumps is read from the trace too.
"""

from __future__ import annotations

import ast
import dataclasses
import ipaddress
import re
import shutil
import socket
import struct
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from switchagg.frames import ETH_IP_UDP_SIZE, ipv4_checksum
from switchagg.jobs import GlobalDrop, JobCounter, JobEntry, Uplink
from switchagg.switch.model import SwitchModel
from switchagg.targets.p4c import P4_DIR
from switchagg.targets.p4job import MAX_JOBS, NUM_SLOTS, PARENT_FLAG
from switchagg.targets.tofino_build import Chip
from switchagg.wire import FLAG_OWNER, HEADER_SIZE, P4_VALUES_PER_PACKET, UDP_PORT, VERSION, PacketType

P4TESTGEN = "p4testgen"
TOOL_DIRS = ("/opt/tofino/bin",)
HALF = P4_VALUES_PER_PACKET // 2  # values per pass (p4/tna/include/types.p4)
RECIRC_FIELDS = ("cell", "job_index", "ingress_port", "worker_bit", "other_workers", "all_workers")
TREE_RECIRC_FIELDS = (*RECIRC_FIELDS, "parent_bit")  # where the program serves trees (SA_TREES)
BRIDGE_NONE, BRIDGE_FLOOD, BRIDGE_RESULT = 0, 1, 2  # SA_BRIDGE_* (types.p4)

# Per chip: p4testgen's target and architecture, the chip's macro, the ports its tests may use: 64 of pipe
# 0's front-panel ports, and its recirculation port (P4Testgen drops a path whose egress port is outside
# these, so without it no contribution would recirculate)
CHIPS = {
    Chip.TOFINO: ("tofino", "tna", 1, "0:63,68:68"),
    Chip.TOFINO2: ("tofino2", "t2na", 2, "8:71,6:6"),
}


# ---- running P4Testgen -----------------------------------------------------------------------------

# What a control plane and earlier packets can produce, as P4Testgen path constraints in a copy of the
# program: an admission entry as p4job.plan and tofino.py write it (rank r of n: bit 1 << r, the job's
# workers (1 << n) - 1, slots inside the pool, the pipe's recirculation port; with trees, a level's parent
# is worker n, its bit in every entry, 0 in a flat job's), and a copy's worker bitmap as packets leave it
# (the job's workers only, never empty once a run's generation is in the tag; the parent's bit only once
# every child's is there).
_ADMIT_ASSUMPTIONS = """\
        testgen_assume(job_index < SA_MAX_JOBS);
        testgen_assume(hdr.sa.worker < SA_MAX_WORKERS && worker_bit == 32w1 << (bit<32>)hdr.sa.worker);
        testgen_assume(all_workers != 0 && all_workers & (all_workers + 1) == 0 && all_workers & worker_bit != 0);
        testgen_assume(other_workers == all_workers & ~worker_bit);
        testgen_assume(slot_count != 0 && (bit<17>)slot_base + (bit<17>)slot_count <= SA_NUM_SLOTS);
        testgen_assume(recirc_port == SA_TESTGEN_RECIRC_PORT);
#ifdef SA_TREES
        testgen_assume(parent_bit == 0 || parent_bit == (all_workers >> 1) + 1 && worker_bit != parent_bit);
        testgen_assume(hdr.sa.type[0:0] == 1);  /* a worker's entry: its key's type bit */
#endif
"""
# A level's entry for its parent's RESULTs (tofino.py's _admit_result): this switch is child 0..31 of the parent's
# job, n >= 1 children of its own, the parent bit n.
_ADMIT_RESULT_ASSUMPTIONS = """\
        testgen_assume(job_index < SA_MAX_JOBS && hdr.sa.worker < SA_MAX_WORKERS);
        testgen_assume(all_workers > 1 && all_workers & (all_workers + 1) == 0 && parent_bit == (all_workers >> 1) + 1);
        testgen_assume(other_workers == all_workers & ~parent_bit);
        testgen_assume(slot_count != 0 && (bit<17>)slot_base + (bit<17>)slot_count <= SA_NUM_SLOTS);
        testgen_assume(recirc_port == SA_TESTGEN_RECIRC_PORT);
        testgen_assume(hdr.sa.type[0:0] == 0);  /* the parent's entry: its key's type bit */
"""
_WORKERS_ASSUMPTION = """\
            testgen_assume(value != 0 && value & ~md.all_workers == 0);
#ifdef SA_TREES
            testgen_assume(value & md.parent_bit == 0 || value == md.all_workers);
#endif
"""

# What arrives on the recirculation port is what the first pass sends there (recirculate() in main.p4): a
# contribution the parser took as well formed (IPv4 of 20 bytes, unfragmented, UDP to the switchagg port,
# the lengths of K values; version 1, CONTRIB, no flag but the copy, worker < 32, owner 0, count K), of a
# run's generation (admission drops 0), behind the recirculation header admission filled in: the cell
# slot_base + slot inside the pool (so at least the slot), a job index, the host port it came in on, and
# the worker bits of an admission entry as above; with trees, also a parent's RESULT, whose worker bit is
# the parent's. P4Testgen otherwise makes up any bits for all of it.
_SECOND_PASS_ASSUMPTIONS = """\
        testgen_assume(hdr.recirc.cell < SA_NUM_SLOTS && hdr.sa.slot <= hdr.recirc.cell);
        testgen_assume(hdr.recirc.job_index < SA_MAX_JOBS);
        testgen_assume(hdr.recirc.ingress_port < 512 && hdr.recirc.ingress_port != SA_TESTGEN_RECIRC_PORT);
#ifdef SA_TREES
        testgen_assume(hdr.sa.worker < SA_MAX_WORKERS);
        testgen_assume(hdr.sa.type == SA_TYPE_CONTRIB && hdr.recirc.worker_bit == 32w1 << (bit<32>)hdr.sa.worker
                       && (hdr.recirc.parent_bit == 0 || hdr.recirc.parent_bit == (hdr.recirc.all_workers >> 1) + 1
                           && hdr.recirc.worker_bit != hdr.recirc.parent_bit)
                       || hdr.sa.type == SA_TYPE_RESULT && hdr.recirc.all_workers > 1
                          && hdr.recirc.parent_bit == (hdr.recirc.all_workers >> 1) + 1
                          && hdr.recirc.worker_bit == hdr.recirc.parent_bit);
#else
        testgen_assume(hdr.sa.worker < SA_MAX_WORKERS && hdr.recirc.worker_bit == 32w1 << (bit<32>)hdr.sa.worker);
        testgen_assume(hdr.sa.type == SA_TYPE_CONTRIB);
#endif
        testgen_assume(hdr.recirc.all_workers & (hdr.recirc.all_workers + 1) == 0
                       && hdr.recirc.all_workers & hdr.recirc.worker_bit != 0);
        testgen_assume(hdr.recirc.other_workers == hdr.recirc.all_workers & ~hdr.recirc.worker_bit);
        testgen_assume(hdr.ethernet.ether_type == SA_ETHERTYPE_IPV4 && hdr.ipv4.ihl == 5 && hdr.ipv4.flags[0:0] == 0
                       && hdr.ipv4.frag_offset == 0 && hdr.ipv4.protocol == SA_IP_PROTOCOL_UDP);
        testgen_assume(hdr.ipv4.total_len == SA_CONTRIB_IP_BYTES
                       && hdr.udp.dst_port == SA_UDP_PORT && hdr.udp.length == SA_CONTRIB_UDP_BYTES);
        testgen_assume(hdr.sa.version == SA_VERSION && hdr.sa.flags & ~SA_FLAG_COPY == 0);
        testgen_assume(hdr.sa.owner == 0 && hdr.sa.count == SA_VALUES && hdr.sa.generation != 0);
"""

# The values are any bits to the program (no branch reads them), and P4Testgen, left free, gives zeros
# everywhere, under which a sum, a swapped half or a value in the wrong place would all look right. So
# they are pinned: the packet's, per header, to distinct non-zero multiples of a constant (large enough
# that sums wrap), and a value register's cell, where a pass reads it, to the packet's value plus another.
_VALUE_PATTERNS = {"vals_active": 0x01020305, "vals_tail": 0x0A0B0C0D, "vals_head": 0x10203041}
_REGISTER_ASSUMPTION = "            testgen_assume(value == hdr.vals_active.v##n + 32w0x7F00FF01); \\\n"


def _pinned(*headers: str) -> str:
    """``testgen_assume`` lines giving each value of ``headers`` its pattern (:data:`_VALUE_PATTERNS`)."""
    return "".join(f"        testgen_assume(hdr.{h}.v{j:02d} == 32w{_VALUE_PATTERNS[h] * (j + 1) & 0xFFFFFFFF:#x});\n"
                   for h in headers for j in range(HALF))


def prepare_program(chip: Chip, dest: Path) -> Path:
    """A copy of ``p4/tna`` (and ``p4/include``) under ``dest`` for P4Testgen to run; its main.p4.

    Two kinds of change, neither of them to the program's semantics, and bf-p4c never sees this copy:

    * ``testgen_assume`` lines (P4Testgen's extern) only constrain what P4Testgen may pick for the
      control plane's data, the registers' initial values and a recirculated packet;
    * the parser's ``recirculation_ports`` value set, which P4Testgen never matches (its value sets
      stay empty, so no second pass would be generated), becomes the one port the control plane puts
      in it for pipe 0 (``tofino.py``: the chip's recirculation port), as a constant select.

    Each is made at an anchor that must occur exactly once, so that a change to the program that
    moves an anchor fails here instead of silently dropping a change.
    """
    root = dest / "p4"
    if root.exists():
        shutil.rmtree(root)
    shutil.copytree(P4_DIR / "tna", root / "tna")
    shutil.copytree(P4_DIR / "include", root / "include")
    recirc = chip.recirculation_port

    def patch(name: str, anchor: str, text: str, *, replace: bool = False, count: int = 1) -> None:
        path = root / "tna" / name
        src = path.read_text()
        if src.count(anchor) != count:
            raise AssertionError(f"p4/tna/{name}: expected {count} of {anchor!r} to change for P4Testgen")
        path.write_text(src.replace(anchor, text if replace else anchor + text))

    patch("admission.p4", "        md.admitted = 1;\n        md.job_index = job_index;\n        md.cell = slot_base + "
          "hdr.sa.slot;\n        md.generation = generation;\n", _ADMIT_ASSUMPTIONS)  # admit's, not admit_result's
    patch("admission.p4", "        md.parent_bit = parent_bit;\n        hdr.sa.job = job;\n", _ADMIT_RESULT_ASSUMPTIONS)
    parser = root / "tna" / "parser.p4"  # the first of the patched files main.p4 includes
    parser.write_text(f"#include <testgen.p4>\n#define SA_TESTGEN_RECIRC_PORT {recirc}\n" + parser.read_text())
    patch("parser.p4", "            recirculation_ports: second_pass;\n",
          "            SA_TESTGEN_RECIRC_PORT: second_pass;  /* the value set, as the control plane fills it */\n",
          replace=True)
    patch("parser.p4", "        pkt.extract(hdr.vals_head);\n        pkt.extract(hdr.vals_active);\n",
          _SECOND_PASS_ASSUMPTIONS + _pinned("vals_head", "vals_active"))
    patch("parser.p4", "        pkt.extract(hdr.vals_active);\n        pkt.extract(hdr.vals_tail);\n",
          _pinned("vals_active", "vals_tail"))
    patch("values.p4", "        void apply(inout bit<32> value, out bit<32> sum) { \\\n", _REGISTER_ASSUMPTION,
          count=2)  # add's and read's
    for action, out in (("workers_add", "before"), ("workers_read", "held"), ("workers_take", "taken")):
        head = f"(workers) {action} = {{\n        void apply(inout bit<32> value, out bit<32> {out}) {{\n"
        patch("aggregation.p4", head, _WORKERS_ASSUMPTION)
    return root / "tna" / "main.p4"


def find_p4testgen() -> str | None:
    found = shutil.which(P4TESTGEN)
    if found:
        return found
    for d in TOOL_DIRS:
        if (Path(d) / P4TESTGEN).is_file():
            return str(Path(d) / P4TESTGEN)
    return None


@dataclasses.dataclass(frozen=True)
class Generated:
    """One run of P4Testgen: its PTF file, its log, the statement coverage it reported and its command."""

    ptf: Path
    log: Path
    coverage: str  # "412/485 (84.9%)"
    command: list[str]


def generate(chip: Chip, out: Path, *, max_tests: int = 0, seed: int = 1, timeout: float = 300) -> Generated:
    """Run P4Testgen on the assumption-carrying copy of the program for ``chip`` (all paths by default)."""
    tool = find_p4testgen()
    if tool is None:
        raise FileNotFoundError("p4testgen was not found (PATH, /opt/tofino/bin)")
    target, arch, n, ports = CHIPS[chip]
    main = prepare_program(chip, out)
    tests = out / "tests"
    command = [tool, "--target", target, "--arch", arch, "--std", "p4-16", f"-D__TARGET_TOFINO__={n}", *chip.defines(),
               "--max-tests", str(max_tests), "--seed", str(seed), "--out-dir", str(tests), "--test-backend", "PTF",
               "--track-coverage", "STATEMENTS", "--port-ranges", ports, str(main)]
    log = out / "p4testgen.log"
    with log.open("w") as f:
        proc = subprocess.run(command, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, cwd=out)
    if proc.returncode != 0:
        raise RuntimeError(f"p4testgen failed (rc {proc.returncode}), see {log}: {log.read_text()[-2000:]}")
    covered = re.findall(r"Nodes covered: ([0-9.]+) \((\d+)/(\d+)\)", log.read_text())
    coverage = f"{covered[-1][1]}/{covered[-1][2]} ({100 * float(covered[-1][0]):.1f}%)" if covered else "unknown"
    (ptf,) = tests.glob("*.py")
    return Generated(ptf, log, coverage, command)


# ---- reading a PTF test ----------------------------------------------------------------------------

@dataclasses.dataclass
class Expected:
    """A packet P4Testgen expects out: its port, bytes and mask (1 bits compared)."""

    port: int
    data: bytes
    mask: bytearray


@dataclasses.dataclass
class PtfTest:
    """One generated test, as data."""

    name: str
    trace: str
    entries: list[tuple[str, dict[str, int], str, dict[str, int]]]  # table, key, action, action data
    registers: dict[str, dict[int, int]]  # register name -> index -> initial value
    port: int  # ingress port
    packet: bytes
    expected: list[Expected]  # none: dropped


def _value(node: ast.AST, names: dict[str, object]) -> object:
    if isinstance(node, ast.Name):
        return names[node.id]
    return ast.literal_eval(node)


def _tuples(node: ast.AST) -> dict[str, int]:
    """``[gc.KeyTuple('job', 0x9040), ...]`` as ``{'job': 0x9040}``."""
    assert isinstance(node, ast.List)
    out = {}
    for call in node.elts:
        assert isinstance(call, ast.Call) and call.func.attr in ("KeyTuple", "DataTuple"), ast.dump(call)
        if len(call.args) != 2:
            raise ValueError(f"an entry field that is not (name, value): {ast.unparse(call)}")
        out[ast.literal_eval(call.args[0])] = ast.literal_eval(call.args[1])
    return out


def parse_ptf(path: Path) -> Iterator[PtfTest]:
    """Every ``TestN`` class of a P4Testgen PTF file, read from its syntax tree."""
    tree = ast.parse(path.read_text())
    for cls in tree.body:
        if not (isinstance(cls, ast.ClassDef) and re.fullmatch(r"Test\d+", cls.name)):
            continue
        methods = {f.name: f for f in cls.body if isinstance(f, ast.FunctionDef)}
        test = PtfTest(cls.name, ast.get_docstring(cls) or "", [], {}, -1, b"", [])
        for stmt in methods["setupCtrlPlane"].body:
            if not isinstance(stmt, ast.Expr):
                continue
            call = stmt.value
            name = call.func.attr
            if name == "insertTableEntry":
                table, key, action, data = call.args
                test.entries.append((ast.literal_eval(table), _tuples(key), ast.literal_eval(action), _tuples(data)))
            elif name == "setRegisterValue":
                reg, value, index = (ast.literal_eval(a) for a in call.args)
                test.registers.setdefault(reg, {})[index] = value
            else:
                raise ValueError(f"{cls.name}: a control-plane call this harness does not know: {ast.unparse(call)}")
        names: dict[str, object] = {}
        for stmt in methods["sendPacket"].body:
            if isinstance(stmt, ast.Assign):
                names[stmt.targets[0].id] = _value(stmt.value, names)
        test.port, test.packet = names["ig_port"], names["pkt"]
        names = {}
        current: Expected | None = None
        for stmt in methods["verifyPackets"].body:
            if isinstance(stmt, ast.Assign):
                target = stmt.targets[0].id
                if isinstance(stmt.value, ast.Call) and stmt.value.func.id == "Mask":
                    data = names[target]
                    current = Expected(-1, data, bytearray(b"\xff" * len(data)))
                else:
                    names[target] = _value(stmt.value, names)
            elif isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call):
                call = stmt.value
                fname = call.func.attr if isinstance(call.func, ast.Attribute) else call.func.id
                if fname == "set_do_not_care":
                    offset, width = (ast.literal_eval(a) for a in call.args)
                    for bit in range(offset, offset + width):
                        current.mask[bit // 8] &= ~(0x80 >> bit % 8)
                elif fname == "verify_packet":
                    current.port = names[call.args[2].id]
                    test.expected.append(current)
                    current = None
                else:
                    raise ValueError(f"{cls.name}: a verification this harness does not know: {ast.unparse(call)}")
            elif not isinstance(stmt, ast.Pass):  # a drop's test verifies nothing
                raise ValueError(f"{cls.name}: a statement this harness does not know: {ast.unparse(stmt)}")
        yield test


# ---- reading its trace -----------------------------------------------------------------------------

_EMIT = re.compile(r"^\[Emit\]: \{\$headerValid:true;;(.*)\}$")
_FIELD = re.compile(r"(\w+):([^;]+);")
_COMPUTED = re.compile(r"Computed: md\.(\w+) = (\S+);$")


def _sections(trace: str) -> tuple[list[str], list[str]]:
    """The trace's ingress lines (parser and control) and its ingress deparser's lines."""
    lines = [line.strip() for line in trace.splitlines()]
    start = next(i for i, line in enumerate(lines) if "[Control SaIngressDeparser start]" in line)
    end = next(i for i, line in enumerate(lines) if 'copy_out("SaIngressDeparser")' in line)
    return lines[:start], lines[start:end]


def ingress_emits(trace: str) -> list[dict[str, int | None]]:
    """The headers the ingress deparser emitted, in order, as P4Testgen computed them (None: taint).

    The one signed field, the switchagg header's ``int<8>`` exponent, is written negative where P4Testgen
    computed it (the second pass's maximum): it is taken as its 8 bits, as the wire and the model hold it.
    """
    out = []
    for line in _sections(trace)[1]:
        m = _EMIT.match(line)
        if m:
            out.append({k: (None if v.strip() in ("Taint", '"Taint"') else int(v, 0) & 0xFF if k == "exponent"
                            else int(v, 0)) for k, v in _FIELD.findall(m.group(1))})
    return out


def counted(trace: str) -> list[tuple[str, int, int]] | None:
    """The counters the ingress pipeline bumped: ``("global", 0, drop)`` or ``("job", job_index, event)``.

    Counters are no-ops in P4Testgen's model; the trace still says which ``count`` ran, with the
    metadata it indexes by as computed. None if an index is symbolic (not computed).
    """
    md: dict[str, str] = {}
    out: list[tuple[str, int, int]] = []
    for line in _sections(trace)[0]:
        m = _COMPUTED.search(line)
        if m:
            md[m.group(1)] = m.group(2)
        try:
            if "global_drops.count(" in line:
                out.append(("global", 0, int(md["global_drop"], 0)))
            elif "job_counters.count(" in line:
                out.append(("job", int(md["job_index"], 0), int(md["job_event"], 0)))
        except (KeyError, ValueError):
            return None
    return out


# ---- translation into a job and copy state ---------------------------------------------------------

ADMISSION = "SaIngress.admission.admission"
ADMIT, ADMIT_RESULT = "SaIngress.admission.admit", "SaIngress.admission.admit_result"
FIRST_HALF = ("SaIngress.first_half.tag_generation", "SaIngress.first_half.tag_chunk", "SaIngress.first_half.workers")
SECOND_HALF = ("SaIngress.second_half.tag_generation", "SaIngress.second_half.tag_chunk",
               "SaIngress.second_half.workers")
EXPONENT = "SaIngress.exponent.exponent"
VALUES = re.compile(r"SaIngress\.values\.values_(\d\d)$")


class Unmappable(Exception):
    """A test whose entries or registers no legal job and state gives: classified with this reason."""


@dataclasses.dataclass(frozen=True)
class Recirc:
    """``hdr.recirc`` in front of a second pass's packet: what admission found in the first pass (with trees,
    the parent's bit too)."""

    cell: int
    job_index: int
    ingress_port: int
    worker_bit: int
    other_workers: int
    all_workers: int
    parent_bit: int = 0

    @staticmethod
    def size(trees: bool) -> int:
        return struct.calcsize(Recirc.format(trees))

    @staticmethod
    def format(trees: bool) -> str:
        return ">HHHIII" + "I" * trees

    @classmethod
    def unpack(cls, data: bytes, trees: bool) -> Recirc:
        return cls(*struct.unpack(cls.format(trees), data[:cls.size(trees)]))

    def pack(self, trees: bool) -> bytes:
        return struct.pack(self.format(trees), *dataclasses.astuple(self)[:7 if trees else 6])


@dataclasses.dataclass
class Setup:
    """A test's control plane and registers as the model holds them; for a second pass, its recirculation
    header too."""

    model: SwitchModel
    job: JobEntry | None
    job_index: int | None
    worker_bits: tuple[int, int, int] | None  # worker_bit, other_workers, all_workers
    recirc_port: int | None
    recirc: Recirc | None = None
    trees: bool = False  # the program serves trees (Chip.trees: compiled with SA_TREES)
    parent_bit: int = 0  # a level of a tree: its parent's bit in all_workers


def _placeholder(rank: int) -> tuple[str, int]:
    """An address for a rank the test sends nothing from (its admission entry is not in the test)."""
    return (f"198.51.100.{rank + 1}", 50000 + rank)  # TEST-NET-2: never a P4Testgen source


# Where a level's partials go, in a test whose entry says only that the job has a parent: the model's emits to it
# give the exponent and the values (egress writes the rest, from the control plane's replica entry).
PARENT = Uplink(("203.0.113.1", UDP_PORT), 0xFFFF, 31, 0)  # TEST-NET-3


def _children(parent_bit: int, all_workers: int) -> int:
    """A level's children, where ``parent_bit`` is bit n of ``all_workers`` = (1 << (n + 1)) - 1 (else Unmappable)."""
    n = parent_bit.bit_length() - 1
    if n < 1 or parent_bit != 1 << n or all_workers != (1 << (n + 1)) - 1:
        raise Unmappable(f"parent_bit {parent_bit:#x} with all_workers {all_workers:#x}: no level's parent")
    return n


def _check_rank(rank: int, bit: int, other: int, all_workers: int) -> int:
    """The job's worker count, where the worker bits are rank ``rank``'s of a job (else Unmappable)."""
    n = all_workers.bit_length()
    if all_workers == 0 or all_workers != (1 << n) - 1 or rank >= n or bit != 1 << rank:
        raise Unmappable(f"worker {rank} with worker_bit {bit:#x} and all_workers {all_workers:#x}: no job's rank")
    if other != all_workers & ~bit:
        raise Unmappable(f"other_workers {other:#x} is not all_workers without the worker's bit")
    return n


def translate(test: PtfTest, chip: Chip) -> Setup:
    """The job the admission entry belongs to and the copy state its registers hold, in a fresh model
    (for a packet on the recirculation port, :func:`_translate_second_pass`).

    Raises :class:`Unmappable` with the reason where no legal job or reachable state gives them.
    """
    if test.port == chip.recirculation_port:
        return _translate_second_pass(test, chip)
    model = SwitchModel(num_slots=NUM_SLOTS)
    entries = [e for e in test.entries if e[0] == ADMISSION]
    others = [e[0] for e in test.entries if e[0] != ADMISSION]
    if others:
        raise Unmappable(f"entries in {sorted(set(others))}, which this harness does not translate")
    if len(entries) > 1:
        raise Unmappable("more than one admission entry")
    setup = Setup(model, None, None, None, None, trees=chip.trees)
    if entries:
        _, key, action, data = entries[0]
        if action not in (ADMIT, ADMIT_RESULT):
            raise Unmappable(f"admission action {action}")
        if not 0 < data["slot_count"] <= NUM_SLOTS - data["slot_base"]:
            raise Unmappable(f"slots {data['slot_base']}+{data['slot_count']} outside the pool of {NUM_SLOTS}")
        if data["job_index"] >= MAX_JOBS:
            raise Unmappable(f"job index {data['job_index']} >= {MAX_JOBS}")
        if data["recirc_port"] != chip.recirculation_port:
            raise Unmappable(f"recirc_port {data['recirc_port']}, not pipe 0's ({chip.recirculation_port})")
        source = (str(ipaddress.IPv4Address(key["src_addr"])), key["src_port"])
        parent_bit, all_workers = data.get("parent_bit", 0), data["all_workers"]
        if action == ADMIT_RESULT:  # a level's parent's RESULTs: the job the entry's (job, key), the parent the key's
            n = _children(parent_bit, all_workers)
            if data["other_workers"] != all_workers & ~parent_bit:
                raise Unmappable(f"other_workers {data['other_workers']:#x}: not the children of {all_workers:#x}")
            up = Uplink(source, key["job"], key["worker"], key["key"])
            job = JobEntry(data["job"], 1, data["key"], data["slot_base"], data["slot_count"], P4_VALUES_PER_PACKET,
                           tuple(_placeholder(r) for r in range(n)), up)
            bit = parent_bit
        else:
            rank, bit = key["worker"], data["worker_bit"]
            children = all_workers & ~parent_bit
            n = _check_rank(rank, bit, data["other_workers"] & ~parent_bit, children)
            if parent_bit and parent_bit != 1 << n:
                raise Unmappable(f"parent_bit {parent_bit:#x} of a job of {n} workers")
            workers = [_placeholder(r) for r in range(n)]
            workers[rank] = source
            job = JobEntry(key["job"], data["generation"], key["key"], data["slot_base"], data["slot_count"],
                           P4_VALUES_PER_PACKET, tuple(workers), PARENT if parent_bit else None)
        model.add_job(job)
        setup = Setup(model, job, data["job_index"], (bit, data["other_workers"], all_workers), data["recirc_port"],
                      trees=chip.trees, parent_bit=parent_bit)
    _set_registers(test, setup, FIRST_HALF)
    for i, tag in enumerate(model.tag):  # a path that only writes the values reads no value register
        if tag and model.values[i] is None:
            model.values[i] = np.zeros(P4_VALUES_PER_PACKET, dtype=">i4")
    return setup


def _translate_second_pass(test: PtfTest, chip: Chip) -> Setup:
    """A second pass as the model's step it finishes: the worker's contribution, handled whole.

    P4Testgen does not chain passes: it sends the recirculated packet itself (hdr.recirc, then the
    contribution with its first half as the first pass left it) with the second half's registers.
    The model keeps one state for both halves, which is what the halves hold without a loss
    (aggregation.p4); so the copy's tag, workers and exponent are the second half's, the values' second
    half the second half's registers, and the job one the recirculation header and the packet give:
    rank ``worker`` of ``popcount(all_workers)`` at the packet's source address, with the slots from
    ``cell - slot`` (any job holding that cell and slot does the same). The contribution fed to the model
    is the packet behind the recirculation header; its first half is the first pass's result, which
    the second pass carries unchanged, so the model's stored first half is chosen to give that result
    back: a repeat reads the stored half (set to it), a fresh chunk writes the packet's and a new worker
    adds it to a stored half of zeros.
    """
    if test.entries:
        raise Unmappable(f"entries in {sorted({e[0] for e in test.entries})}: the second pass applies no table of the "
                         "control plane's")
    size = Recirc.size(chip.trees)
    if len(test.packet) < size + ETH_IP_UDP_SIZE + HEADER_SIZE + 4 * P4_VALUES_PER_PACKET:
        raise Unmappable("shorter than a recirculated contribution, which the first pass never sends")
    recirc = Recirc.unpack(test.packet, chip.trees)
    frame = test.packet[size:]
    h = _header_fields(frame[ETH_IP_UDP_SIZE:])
    source = (socket.inet_ntoa(frame[26:30]), int.from_bytes(frame[34:36], "big"))
    parent = recirc.parent_bit
    if h["type"] == PacketType.RESULT:
        # A parent's RESULT, its job and key made this job's by the first pass's admission: the model takes it
        # from a parent whose job and key are those (its emits down carry the job's, the same).
        n = _children(parent, recirc.all_workers)
        if recirc.worker_bit != parent or recirc.other_workers != recirc.all_workers & ~parent:
            raise Unmappable(f"a RESULT with worker_bit {recirc.worker_bit:#x}: not its parent's")
        workers = [_placeholder(r) for r in range(n)]
        up = Uplink(source, h["job"], h["worker"], h["key"])
    else:
        n = _check_rank(h["worker"], recirc.worker_bit, recirc.other_workers & ~parent, recirc.all_workers & ~parent)
        if parent and parent != 1 << n:
            raise Unmappable(f"parent_bit {parent:#x} of a job of {n} workers")
        workers = [_placeholder(r) for r in range(n)]
        workers[h["worker"]] = source
        up = PARENT if parent else None
    if not h["slot"] <= recirc.cell < NUM_SLOTS:
        raise Unmappable(f"cell {recirc.cell} for slot {h['slot']}: no job's slot in the pool")
    if recirc.job_index >= MAX_JOBS:
        raise Unmappable(f"job index {recirc.job_index} >= {MAX_JOBS}")
    if recirc.ingress_port >= 1 << 9 or recirc.ingress_port == chip.recirculation_port:
        raise Unmappable(f"came in on port {recirc.ingress_port}, not a host's")
    job = JobEntry(h["job"], h["generation"], h["key"], recirc.cell - h["slot"], h["slot"] + 1, P4_VALUES_PER_PACKET,
                   tuple(workers), up)
    model = SwitchModel(num_slots=NUM_SLOTS)
    model.add_job(job)
    bits = (recirc.worker_bit, recirc.other_workers, recirc.all_workers)
    setup = Setup(model, job, recirc.job_index, bits, chip.recirculation_port, recirc, chip.trees, parent)
    _set_registers(test, setup, SECOND_HALF)
    i = 2 * recirc.cell + (h["flags"] & 1)
    repeat = model.tag[i] == h["generation"] << 32 | h["chunk"] and model.bitmap[i] & recirc.worker_bit
    if model.values[i] is None:
        model.values[i] = np.zeros(P4_VALUES_PER_PACKET, dtype=">i4")
    start = ETH_IP_UDP_SIZE + HEADER_SIZE
    first = np.frombuffer(frame[start:start + 4 * HALF], dtype=">i4")
    model.values[i][:HALF] = first if repeat else 0
    return setup


def _set_registers(test: PtfTest, setup: Setup, half: tuple[str, str, str]) -> None:
    """The copies' state from one half's registers (and the exponent's, and the values), where the test
    gives them.

    A register P4Testgen gives no value for is one the path never reads; it is filled in so that the
    copy's state is one packets can leave (a run's generation in the tag means a worker counted). So is a
    worker bitmap of 0 under a run's generation: the assumptions make every bitmap a path reads non-empty,
    so P4Testgen gives 0 only where the path writes the bitmap without reading it (a fresh chunk).
    """
    model = setup.model
    known = {*half, EXPONENT} if setup.recirc else set(half)
    unknown = sorted(set(test.registers) - known - {r for r in test.registers if VALUES.match(r)})
    if unknown:
        raise Unmappable(f"initial values of {unknown}, which the model has no state for")
    gens, chunks, bitmaps = (test.registers.get(r, {}) for r in half)
    for i in sorted(set(gens) | set(chunks) | set(bitmaps)):
        if i >= 2 * NUM_SLOTS:
            raise Unmappable(f"register index {i} outside the pool")
        gen, chunk = gens.get(i, 0), chunks.get(i, 0)
        bitmap = bitmaps.get(i, 0) or (1 if gen else 0)
        if gen == 0 and (chunk or bitmap):
            raise Unmappable(f"copy {i}: generation 0 with chunk {chunk:#x}, workers {bitmap:#x} (never written)")
        if setup.worker_bits and bitmap & ~setup.worker_bits[2]:
            raise Unmappable(f"copy {i}: workers {bitmap:#x}, not the job's")
        # A level's copy with its parent's bit holds the parent's result: the model's count n + 1, its bitmap
        # the children's (all of them: the program sets the bit only there).
        parent = bitmap & setup.parent_bit
        if parent and bitmap != setup.worker_bits[2]:
            raise Unmappable(f"copy {i}: workers {bitmap:#x}, the parent's bit without every child's")
        model.tag[i], model.bitmap[i], model.count[i] = gen << 32 | chunk, bitmap & ~parent, bitmap.bit_count()
    for i, value in test.registers.get(EXPONENT, {}).items():
        model.exponent[i] = value - 256 if value & 0x80 else value  # int<8>
    for reg, cells in test.registers.items():
        m = VALUES.match(reg)
        if m is None:
            continue
        j = int(m.group(1))
        for index, value in cells.items():
            i, half_of = index >> 1, index & 1
            if model.values[i] is None:
                model.values[i] = np.zeros(P4_VALUES_PER_PACKET, dtype=">i4")
            model.values[i][HALF * half_of + j] = np.int64(value).astype(np.uint32).astype(np.int32)


# ---- what the Tofino program must do, from the model ---------------------------------------------

@dataclasses.dataclass
class Expectation:
    """What ``p4/tna`` must do with a packet: its output (port, bytes; none for a drop or a multicast), the
    multicast group its ingress sends it to (none: unicast or a drop), the headers its ingress deparser
    emits, its counters; and the documented difference applied, if any."""

    out: list[tuple[int, bytes]]
    emits: list[dict[str, int]]
    counters: list[tuple[str, int, int]]
    difference: str | None = None
    group: int | None = None


def _deltas(model: SwitchModel, before: tuple[list[int], dict[int, list[int]]]) -> list[tuple[str, int]]:
    global_before, jobs_before = before
    out = [("global", d) for d in GlobalDrop for _ in range(model.global_counters[d] - global_before[d])]
    for job_id, counts in model.job_counters.items():
        out += [(f"job{job_id}", e) for e in JobCounter for _ in range(counts[e] - jobs_before[job_id][e])]
    return out


def _header_fields(h: bytes) -> dict[str, int]:
    names = ("version", "type", "flags", "worker", "job", "slot", "chunk", "generation", "key", "exponent", "owner",
             "count")
    values = struct.unpack(">BBBBHHIIIbBH", h[:HEADER_SIZE])
    return {n: v & 0xFF if n == "exponent" else v for n, v in zip(names, values, strict=True)}


def _frame_emits(frame: bytes, recirc: bytes | None, values: bool) -> list[dict[str, int]]:
    """The ingress deparser's headers for ``frame`` (Ethernet .. switchagg, and the values when parsed)."""
    eth = {"dst_addr": int.from_bytes(frame[0:6], "big"), "src_addr": int.from_bytes(frame[6:12], "big"),
           "ether_type": int.from_bytes(frame[12:14], "big")}
    ip = frame[14:34]
    ipv4 = {"version": ip[0] >> 4, "ihl": ip[0] & 15, "diffserv": ip[1], "total_len": int.from_bytes(ip[2:4], "big"),
            "identification": int.from_bytes(ip[4:6], "big"), "flags": ip[6] >> 5,
            "frag_offset": int.from_bytes(ip[6:8], "big") & 0x1FFF, "ttl": ip[8], "protocol": ip[9],
            "hdr_checksum": int.from_bytes(ip[10:12], "big"), "src_addr": int.from_bytes(ip[12:16], "big"),
            "dst_addr": int.from_bytes(ip[16:20], "big")}
    udp = dict(zip(("src_port", "dst_port", "length", "checksum"), struct.unpack(">HHHH", frame[34:42]), strict=True))
    out = []
    if recirc is not None:
        trees = len(recirc) == Recirc.size(True)
        out.append(dict(zip(TREE_RECIRC_FIELDS if trees else RECIRC_FIELDS, struct.unpack(Recirc.format(trees), recirc),
                            strict=True)))
    out += [eth, ipv4, udp, _header_fields(frame[ETH_IP_UDP_SIZE:])]
    if values:
        start = ETH_IP_UDP_SIZE + HEADER_SIZE
        for half in range(2):
            vals = struct.unpack(f">{HALF}I", frame[start + 4 * HALF * half:start + 4 * HALF * (half + 1)])
            out.append({f"v{j:02d}": v for j, v in enumerate(vals)})
    return out


def _reply(frame: bytes, header: bytes) -> bytes:
    """The Tofino program's reply_to: addresses swapped, UDP from the switchagg port without checksum, the
    IPv4 checksum worked out afresh, the header replaced, everything after it kept."""
    f = bytearray(frame)
    f[0:6], f[6:12] = frame[6:12], frame[0:6]
    f[26:30], f[30:34] = frame[30:34], frame[26:30]
    f[34:36], f[36:38], f[40:42] = UDP_PORT.to_bytes(2, "big"), frame[34:36], b"\0\0"
    f[24:26] = b"\0\0"
    f[24:26] = ipv4_checksum(bytes(f[14:34])).to_bytes(2, "big")
    f[ETH_IP_UDP_SIZE:ETH_IP_UDP_SIZE + HEADER_SIZE] = header
    return bytes(f)


def _owner_marked(frame: bytes) -> bool:
    """A switchagg header of version 1 with FLAG_OWNER or an owner: a reduce-scatter's, which p4/tna does
    not take (docs/tofino.md, "No reduce-scatter yet")."""
    h = frame[ETH_IP_UDP_SIZE:ETH_IP_UDP_SIZE + HEADER_SIZE]
    return len(h) == HEADER_SIZE and h[0] == VERSION and bool(h[2] & FLAG_OWNER or h[21])


def tofino_expectation(setup: Setup, frame: bytes, port: int) -> Expectation:
    """What ``p4/tna`` does with ``frame`` from ``port``, worked out from :meth:`SwitchModel.process_frame`.

    The model handles a datagram whole; the Tofino program's first pass ends a contribution that
    passed the tag by recirculating it (hdr.recirc in front, the first half of the values as the
    model's copy now holds them) and counts ``contributions`` there for a fresh chunk or a new worker;
    results and repeats are the second pass's (a packet that arrives with hdr.recirc:
    :func:`_second_pass_expectation`). Where
    ``docs/tofino.md`` documents a difference (reduce-scatter's owner; a frame shorter than its
    datagram, of a length the parser does not read to its end), the documented behaviour is expected
    and the difference named.
    """
    if setup.recirc is not None:
        return _second_pass_expectation(setup, frame[Recirc.size(setup.trees):])
    model, job = setup.model, setup.job
    difference = None
    datagram = _datagram(frame)
    if datagram is not None and _owner_marked(frame) and _lengths_right(frame):
        difference = "reduce-scatter (FLAG_OWNER or an owner): malformed on Tofino"
        return Expectation([], [], [("global", 0, GlobalDrop.MALFORMED)], difference)
    if (datagram is not None and len(frame) < 14 + datagram[0]
            and not _parsed_to_its_end(frame, datagram[1], setup.trees)):
        difference = "a frame shorter than its datagram, which the parser does not read to its end"
        frame = frame + bytes(14 + datagram[0] - len(frame))
    before = (list(model.global_counters), {j: list(c) for j, c in model.job_counters.items()})
    i = None
    if job is not None and len(frame) >= ETH_IP_UDP_SIZE + HEADER_SIZE:
        h = _header_fields(frame[ETH_IP_UDP_SIZE:])
        i = 2 * (job.slot_base + h["slot"]) + (h["flags"] & 1)
    emits = model.process_frame(frame)
    deltas = _deltas(model, before)
    index = setup.job_index
    counters = [("global", 0, int(e)) if kind == "global" else ("job", index, int(e)) for kind, e in deltas]
    events = {e for kind, e in deltas if kind != "global"}
    bridge = {"kind": BRIDGE_NONE, "ingress_port": port}
    if events & {JobCounter.CONTRIBUTIONS, JobCounter.RESULTS_MULTICAST, JobCounter.RESULTS_UNICAST,
                 JobCounter.DUPLICATE_PENDING, JobCounter.PARTIALS_RESENT, JobCounter.RESULTS_FROM_PARENT}:
        # A contribution that reached the values, or a parent's RESULT a copy took (admission made its job and
        # key this job's): the first pass sends it round with its first half done
        h = _header_fields(frame[ETH_IP_UDP_SIZE:])
        bit, other, all_workers = setup.worker_bits
        recirc = Recirc(job.slot_base + h["slot"], index, port, bit, other, all_workers, setup.parent_bit)
        head = bytearray(frame[:ETH_IP_UDP_SIZE + HEADER_SIZE])
        if h["type"] == PacketType.RESULT:
            struct.pack_into(">H", head, ETH_IP_UDP_SIZE + 4, job.job_id)
            struct.pack_into(">I", head, ETH_IP_UDP_SIZE + 16, job.key)
        first = model.values[i][:HALF].astype(">i4").tobytes()
        packed = recirc.pack(setup.trees)
        out = packed + bytes(head) + first + frame[len(head) + 4 * HALF:]
        counted = [c for c in counters if c[2] == JobCounter.CONTRIBUTIONS]
        return Expectation([(setup.recirc_port, out)], [bridge, *_frame_emits(out[len(packed):], packed, True)],
                           counted, difference)
    if emits:
        (emit,) = emits  # a probe's reply or a query's PENDING: back to the sender alone
        src = (socket.inet_ntoa(frame[26:30]), int.from_bytes(frame[34:36], "big"))
        assert emit.dst == src, f"the model answered {emit.dst}, not the sender {src}"
        out = _reply(frame, emit.payload()[:HEADER_SIZE])
        return Expectation([(port, out)], [bridge, *_frame_emits(out, None, False)], counters, difference)
    return Expectation([], [], counters, difference)


def _second_pass_expectation(setup: Setup, frame: bytes) -> Expectation:
    """What the second pass does with the contribution ``frame`` (behind hdr.recirc), from the model's
    handling of it whole (:func:`_translate_second_pass` set the state).

    The first pass counted ``contributions`` (the model counts it with the rest); the second counts the
    outcome: the finished sum to the job's multicast group (job index + 1), the packet's headers kept
    but the Ethernet source (the destination it was sent to) and the exponent (the maximum kept), the
    bridge saying RESULT for egress, which makes each replica its worker's (``egress.p4``: addresses,
    type, rank; so the model's replicas must differ in nothing else); a stored sum back to the sender
    on the port it came in on (``hdr.recirc.ingress_port``), a reply as the first pass makes one;
    ``duplicate_pending``, ``stale`` or, for a contribution counted into an unfinished sum, nothing, as
    drops.
    """
    model, job, recirc = setup.model, setup.job, setup.recirc
    before = (list(model.global_counters), {j: list(c) for j, c in model.job_counters.items()})
    emits = model.process_frame(frame)
    counters = [("global", 0, int(e)) if kind == "global" else ("job", setup.job_index, int(e))
                for kind, e in _deltas(model, before) if kind == "global" or e != JobCounter.CONTRIBUTIONS]
    h = _header_fields(frame[ETH_IP_UDP_SIZE:])
    start = ETH_IP_UDP_SIZE + HEADER_SIZE
    end = start + 4 * P4_VALUES_PER_PACKET
    events = {e for kind, _, e in counters if kind == "job"}
    bridge = {"kind": BRIDGE_RESULT, "ingress_port": setup.recirc_port}
    if events & {JobCounter.RESULTS_MULTICAST, JobCounter.RESULTS_FROM_PARENT}:
        # Down to every worker: egress makes each replica its worker's (addresses, type, rank); ingress sends the
        # packet's header as it has it (a contribution's, or the parent's RESULT with the job's id and key)
        own = emits[0]
        for rank, (emit, dst) in enumerate(zip(emits, job.workers, strict=True)):
            assert emit.dst == dst and emit.header == own.header._replace(worker=rank), (rank, emit, own)
            assert np.array_equal(emit.values, own.values), f"replica {rank}'s values differ from rank 0's"
        header = own.header._replace(type=h["type"], worker=h["worker"]).pack()
        out = frame[:6] + frame[:6] + frame[12:ETH_IP_UDP_SIZE] + header + own.values.tobytes() + frame[end:]
        return Expectation([], [bridge, *_frame_emits(out, None, True)], counters, group=recirc.job_index + 1)
    if events & {JobCounter.PARTIALS_UP, JobCounter.PARTIALS_RESENT}:
        # Up to the parent through the job's uplink group: egress's to_parent writes its addresses, job, key and
        # this switch's index; ingress sends the packet's header with the kept exponent, and the partial sum
        (emit,) = emits
        assert emit.dst == job.parent.address, f"the model sent the partial to {emit.dst}"
        header = emit.header._replace(worker=h["worker"], job=h["job"], key=h["key"]).pack()
        out = frame[:6] + frame[:6] + frame[12:ETH_IP_UDP_SIZE] + header + emit.values.tobytes() + frame[end:]
        return Expectation([], [bridge, *_frame_emits(out, None, True)], counters,
                           group=recirc.job_index + 1 | PARENT_FLAG)
    if emits:
        (emit,) = emits  # a repeat of a finished round: the stored sum back to its sender
        src = (socket.inet_ntoa(frame[26:30]), int.from_bytes(frame[34:36], "big"))
        assert emit.dst == src, f"the model answered {emit.dst}, not the sender {src}"
        out = _reply(frame, emit.header.pack())
        out = out[:start] + emit.values.tobytes() + out[end:]
        bridge = {"kind": BRIDGE_NONE, "ingress_port": setup.recirc_port}
        return Expectation([(recirc.ingress_port, out)], [bridge, *_frame_emits(out, None, True)], counters)
    return Expectation([], [], counters)


def _datagram(frame: bytes) -> tuple[int, int] | None:
    """(IPv4 length, UDP length) of a switchagg datagram the parser takes (IPv4 of 20 bytes, UDP, unfragmented,
    to the switchagg port), or None."""
    if len(frame) < ETH_IP_UDP_SIZE or frame[12:14] != b"\x08\x00" or frame[14] & 15 != 5 or frame[23] != 17:
        return None
    if int.from_bytes(frame[20:22], "big") & 0x3FFF or int.from_bytes(frame[36:38], "big") != UDP_PORT:
        return None
    return int.from_bytes(frame[16:18], "big"), int.from_bytes(frame[38:40], "big")


def _parsed_to_its_end(frame: bytes, udp_len: int, trees: bool) -> bool:
    """Whether the parser reads a datagram to its last byte (so a frame cut short of it is malformed, as in the
    model): one of a header's length, or a contribution's (with trees, a RESULT's too) whose header the parser
    takes as well formed."""
    h = frame[ETH_IP_UDP_SIZE:ETH_IP_UDP_SIZE + HEADER_SIZE]
    if udp_len == 8 + HEADER_SIZE or len(h) < HEADER_SIZE:
        return True
    types = (PacketType.CONTRIB, PacketType.RESULT) if trees else (PacketType.CONTRIB,)
    return udp_len == 8 + HEADER_SIZE + 4 * P4_VALUES_PER_PACKET and h[0] == VERSION and h[1] in types \
        and not h[2] & ~1 and h[3] < 32 and h[21] == 0 and h[22:24] == P4_VALUES_PER_PACKET.to_bytes(2, "big")


def _lengths_right(frame: bytes) -> bool:
    """The lengths validation checks before the header's fields: IPv4 = UDP + 20, UDP = 32 + 4 * count."""
    ip_len, udp_len = _datagram(frame)
    count = int.from_bytes(frame[ETH_IP_UDP_SIZE + 22:ETH_IP_UDP_SIZE + 24], "big")
    return ip_len == udp_len + 20 and udp_len == 8 + HEADER_SIZE + 4 * count and count < 0x4000


# ---- comparing -------------------------------------------------------------------------------------

def p4testgen_view(out: bytes) -> bytes:
    """A packet as P4Testgen's egress expects it: its first byte gone.

    P4Testgen takes the ``@flexible`` bridge header (8 + 9 bits) at its declared 17 bits, where bf-p4c
    pads it to whole bytes; its egress then leaves the packet a byte short (and the first byte left
    garbled). docs/tofino.md records it with the smallest program that shows it.
    """
    return out[1:]


_EGRESS_PORT = re.compile(r"\*eg_intr_md\.egress_port = (\d+);")
_EGRESS_BRIDGE = re.compile(r"hdr\.bridge\.kind = (0x[0-9A-F]+) \| hdr\.bridge\.ingress_port = (0x[0-9A-F]+)")
_GROUP = re.compile(r"Computed: ig_tm_md\.mcast_grp_a = (\d+);")
_DROP_CTL = "Computed: ig_dprsr_md.drop_ctl = 1;"


@dataclasses.dataclass
class Ingress:
    """What P4Testgen's ingress did: dropped, or sent to a port or a multicast group; and whether its
    egress left the packet as ingress sent it (see :func:`p4testgen_view`)."""

    dropped: bool
    port: int | None
    egress_passes: bool
    group: int | None


def ingress_outcome(trace: str) -> Ingress:
    """P4Testgen's ingress outcome, and what its egress made of the bridge header.

    Its egress reads the bridge kind from the wrong bits (the last two of the ingress port and the first
    six of the Ethernet destination, the 17-bit ``@flexible`` header misplaced): where those read as
    RESULT or FLOOD, egress rewrites or drops a packet whose kind ingress set to NONE.

    Its traffic manager has no replication engine: a packet ingress sends to a multicast group (and
    does not drop) gets a taint egress port and is dropped. The group, as ingress computed it, is
    read from the trace.
    """
    lines = [line.strip() for line in trace.splitlines()]
    check = next(i for i, line in enumerate(lines) if "*.check_tofino_drop()" in line)
    dropped = check + 1 < len(lines) and "*.tofino_drop()" in lines[check + 1]
    port = _EGRESS_PORT.search(trace)
    read = _EGRESS_BRIDGE.search("\n".join(lines[check:]))
    passes = read is not None and int(read.group(1), 16) not in (BRIDGE_FLOOD, BRIDGE_RESULT)
    ingress = "\n".join(lines[:check])
    group = _GROUP.search(ingress)
    multicast = None if group is None or _DROP_CTL in ingress else int(group.group(1))
    return Ingress(dropped, None if dropped or port is None else int(port.group(1)), passes, multicast)


EGRESS_MISREAD = "P4Testgen's egress read the bridge as a replica's or a flood's: its output packet not compared"
NO_PRE = "multicast, which P4Testgen's model has no replication engine for: its replicas not compared"


def compare(test: PtfTest, expect: Expectation) -> tuple[list[str], str | None]:
    """Every way P4Testgen's expectation and the Tofino program's, from the model, differ (empty: agree),
    and why the packet out was not compared where it was not.

    The ingress pipeline's outcome (drop, or the port and every header field its deparser emits) and
    its counters come from the trace; the packet out, from the test's expectation, only where
    P4Testgen's egress read the bridge header that ingress wrote (else it may take a reply for a
    multicast replica and drop it: docs/tofino.md). A multicast's group is compared, and its headers as
    ingress emits them; its replicas are not there to compare (:func:`ingress_outcome`).
    """
    problems = []
    ingress = ingress_outcome(test.trace)
    want = [p for p, _ in expect.out]
    got = [] if ingress.dropped else [ingress.port]
    if ingress.group != expect.group:
        problems.append(f"ingress multicasts to group {ingress.group}, model {expect.group}")
    elif expect.group is None and got != want:
        problems.append(f"ingress sends to {got or 'nothing'}, model {want or 'nothing'}")
    elif expect.out or expect.group is not None:
        emitted = ingress_emits(test.trace)
        if len(emitted) != len(expect.emits):
            problems.append(f"headers emitted: P4Testgen {len(emitted)}, model {len(expect.emits)}")
        for k, (mine, theirs) in enumerate(zip(expect.emits, emitted, strict=False)):
            if sorted(mine) != sorted(theirs):
                problems.append(f"header {k}: P4Testgen's fields {sorted(theirs)}, model's {sorted(mine)}")
                continue
            for name, v in theirs.items():
                if v is None or name == "hdr_checksum":  # P4Testgen's checksum is taint
                    continue
                if mine[name] != v:
                    problems.append(f"header {k} field {name}: P4Testgen {v:#x}, model {mine[name]:#x}")
    counters = counted(test.trace)
    if counters is None:
        problems.append("a counter index P4Testgen left symbolic")
    elif sorted(counters) != sorted(expect.counters):
        problems.append(f"counters: P4Testgen {counters}, model {expect.counters}")
    if not expect.out:
        if test.expected:
            problems.append(f"P4Testgen expects packets out of {[e.port for e in test.expected]}, model none")
        return problems, None if expect.group is None else NO_PRE
    if not ingress.egress_passes:
        return problems, EGRESS_MISREAD
    if [e.port for e in test.expected] != want:
        problems.append(f"packets out of {[e.port for e in test.expected]}, model {want}")
        return problems, None
    for e, (_, data) in zip(test.expected, expect.out, strict=True):
        view = p4testgen_view(data)
        if len(e.data) != len(view):
            problems.append(f"length: P4Testgen {len(e.data)}, model {len(view)} (less its first byte)")
            continue
        bad = [k for k in range(1, len(view)) if (e.data[k] ^ view[k]) & e.mask[k]]
        if bad:
            problems.append(f"bytes {bad[:8]}: P4Testgen {e.data[bad[0]]:#04x}, model {view[bad[0]]:#04x}")
    return problems, None


@dataclasses.dataclass
class Report:
    """One chip's run: tests compared (and of them, the second pass's), classified out (with reasons),
    disagreements."""

    chip: Chip
    generated: Generated
    total: int = 0
    compared: list[str] = dataclasses.field(default_factory=list)
    outputs: int = 0  # compared tests whose packet out was compared byte for byte
    second_pass: list[str] = dataclasses.field(default_factory=list)  # compared, sent in on the recirculation port
    second_outputs: int = 0  # of those, with their packet out compared byte for byte
    differences: dict[str, list[str]] = dataclasses.field(default_factory=dict)  # compared with this said
    unmappable: dict[str, str] = dataclasses.field(default_factory=dict)
    disagreements: dict[str, list[str]] = dataclasses.field(default_factory=dict)

    def summary(self) -> str:
        reasons: dict[str, int] = {}
        for r in self.unmappable.values():
            reasons[r.split(":")[0]] = reasons.get(r.split(":")[0], 0) + 1
        notes = {k: len(v) for k, v in self.differences.items()}
        return (f"{self.chip.value[0]}: {self.total} tests, {len(self.compared)} compared ({self.outputs} with their "
                f"packet out byte for byte; {notes}), {len(self.second_pass)} of them second passes "
                f"({self.second_outputs} with their packet out), "
                f"{len(self.unmappable)} classified out {reasons}, {len(self.disagreements)} disagree; "
                f"statement coverage {self.generated.coverage}")


def run(chip: Chip, generated: Generated) -> Report:
    """Translate, expect and compare every test of one P4Testgen run."""
    report = Report(chip, generated)
    for test in parse_ptf(generated.ptf):
        report.total += 1
        try:
            setup = translate(test, chip)
        except Unmappable as exc:
            report.unmappable[test.name] = str(exc)
            continue
        expect = tofino_expectation(setup, test.packet, test.port)
        problems, partial = compare(test, expect)
        if problems:
            report.disagreements[test.name] = problems
            continue
        report.compared.append(test.name)
        report.outputs += bool(expect.out) and partial is None
        if setup.recirc is not None:
            report.second_pass.append(test.name)
            report.second_outputs += bool(expect.out) and partial is None
        for note in (expect.difference, partial):
            if note:
                report.differences.setdefault(note, []).append(test.name)
    return report
