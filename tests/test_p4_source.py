"""The P4 programs' headers and constants agree with switchagg/wire.py and the counter enums (p4/include is
what every architecture shares; p4/v1model and p4/tna the programs)."""

from __future__ import annotations

import dataclasses
import random
import re
from pathlib import Path

import pytest

from switchagg import wire
from switchagg.config import Endpoint
from switchagg.errors import ConfigError
from switchagg.frames import ipv4_checksum
from switchagg.jobs import GlobalDrop, JobCounter
from switchagg.loopback import loopback_job
from switchagg.targets import bmv2, p4job

P4 = Path(__file__).resolve().parents[1] / "p4"
SHARED = P4 / "include"  # what every architecture shares: sizes, constants, the wire's headers
V1MODEL_HEADERS = P4 / "v1model" / "include" / "headers.p4"


def header_fields(name: str, path: Path = SHARED / "headers.p4") -> list[tuple[str, int]]:
    return [(f, bits) for f, bits, _ in typed_header_fields(name, path)]


def typed_header_fields(name: str, path: Path = SHARED / "headers.p4") -> list[tuple[str, int, bool]]:
    """A header's fields as (name, bits, signed), from ``bit<N>`` and ``int<N>`` declarations."""
    text = path.read_text()
    body = re.search(r"header\s+" + name + r"\s*\{(.*?)\}", text, re.S).group(1)
    return [(f, int(b), kind == "int") for kind, b, f in re.findall(r"\b(bit|int)<(\d+)>\s+(\w+);", body)]


def constants() -> dict[str, int]:
    """The shared numbers: typed constants of constants.p4 and the plain numbers of both files."""
    consts: dict[str, int] = {}
    for name in ("size.p4", "constants.p4"):
        text = (SHARED / name).read_text()
        consts.update({n: int(v, 0) for n, v in re.findall(r"const\s+bit<\d+>\s+(\w+)\s*=\s*(\w+);", text)})
        consts.update({n: int(v, 0) for n, v in re.findall(r"#define\s+(SA_\w+)\s+(\d+)", text)})
    return consts


def test_switchagg_header_is_the_wire_fields():
    """The shared header: one P4 field per wire field, in order, named, sized and signed as wire.py has them."""
    assert typed_header_fields("switchagg_h") == [(f.name, f.bits, f.signed) for f in wire.FIELDS]
    assert sum(b for _, b in header_fields("switchagg_h")) == 8 * wire.HEADER_SIZE


def test_packed_switchagg_header_matches_wire_fields():
    """v1model's: in order and width, each P4 field being one wire field or neighbours named after them (a_b_c)."""
    wire_fields = iter(wire.FIELDS)
    for name, bits in header_fields("switchagg_packed_h", V1MODEL_HEADERS):
        parts = [next(wire_fields) for _ in name.split("_")]
        assert (name, bits) == ("_".join(f.name for f in parts), sum(f.bits for f in parts))
    assert next(wire_fields, None) is None, "wire fields missing from switchagg_packed_h"


def test_outer_headers_are_ethernet_ipv4_udp():
    widths = {name: sum(b for _, b in header_fields(name)) for name in ("ethernet_h", "ipv4_h", "udp_h")}
    assert widths == {"ethernet_h": 14 * 8, "ipv4_h": 20 * 8, "udp_h": 8 * 8}
    assert header_fields("outer_h", V1MODEL_HEADERS) == [("head", sum(widths.values()))]


def test_k_is_stated_once():
    """K = 64 has one definition on the P4 side, in size.p4; everything else derives from it."""
    definition = re.compile(r"\s*(#define|const\s+\S+)\s+SA_VALUES\b")
    definitions = [(path.relative_to(P4).as_posix(), line.strip()) for path in sorted(P4.rglob("*.p4"))
                   for line in path.read_text().splitlines() if definition.match(line)]
    assert definitions == [("include/size.p4", "#define SA_VALUES 64")]


def test_values_header_is_k_int32():
    assert header_fields("switchagg_values_h", V1MODEL_HEADERS) == [("values", 32 * wire.P4_VALUES_PER_PACKET)]


def test_carry_mask_has_bit_31_of_every_value():
    text = V1MODEL_HEADERS.read_text()
    mask = int(re.search(r"#define SA_VALUE_TOPS 2048w0x([0-9a-f]+)", text).group(1), 16)
    assert mask == sum(1 << (32 * j + 31) for j in range(wire.P4_VALUES_PER_PACKET))


def test_constants_match():
    c = constants()
    assert c["SA_UDP_PORT"] == wire.UDP_PORT and c["SA_VERSION"] == wire.VERSION
    assert c["SA_MAX_WORKERS"] == wire.MAX_WORKERS and c["SA_VALUES"] == wire.P4_VALUES_PER_PACKET
    assert c["SA_HEADER_BYTES"] == wire.HEADER_SIZE and c["SA_FLAG_COPY"] == wire.FLAG_COPY
    assert c["SA_FLAG_OWNER"] == wire.FLAG_OWNER
    for t in wire.PacketType:
        assert c[f"SA_TYPE_{t.name}"] == t.value
    for d in GlobalDrop:
        assert c[f"SA_DROP_{d.name}"] == d.value
    assert c["SA_NUM_GLOBAL_DROPS"] == len(GlobalDrop)
    for j in JobCounter:
        assert c[f"SA_JOB_{j.name}"] == j.value
    assert c["SA_NUM_JOB_COUNTERS"] == len(JobCounter) <= c["SA_JOB_COUNTER_STRIDE"]
    stride = c["SA_JOB_COUNTER_STRIDE"]
    assert stride & (stride - 1) == 0  # a power of two: the index is job ++ event
    assert c["SA_NUM_SLOTS"] == p4job.NUM_SLOTS and c["SA_NUM_COPIES"] == 2 * p4job.NUM_SLOTS
    assert c["SA_MAX_JOBS"] == p4job.MAX_JOBS and c["SA_FLOOD_GROUP"] == p4job.FLOOD_GROUP
    assert c["SA_JOB_COUNTER_STRIDE"] == p4job.JOB_COUNTER_STRIDE
    assert c["SA_MAX_JOBS"] < c["SA_FLOOD_GROUP"]  # job groups are 1..SA_MAX_JOBS
    assert c["SA_NUM_JOB_IDS"] == 1 << wire.FIELDS[[f.name for f in wire.FIELDS].index("job")].bits
    # a worker's entry each, and in a tree a parent's (admission) and one up to it (replica)
    assert c["SA_ADMISSION_SIZE"] == c["SA_REPLICA_SIZE"] == c["SA_MAX_JOBS"] * (c["SA_MAX_WORKERS"] + 1)
    # a job's uplink group is its group | PARENT_FLAG: above every job's group, below the flood group
    assert c["SA_MAX_JOBS"] < p4job.PARENT_FLAG and p4job.PARENT_FLAG + c["SA_MAX_JOBS"] < c["SA_FLOOD_GROUP"]
    assert c["SA_MAX_WORKERS"] * c["SA_MAX_JOBS"] <= c["SA_NUM_COPIES"]


def header_mask(name: str) -> int:
    """A mask of p4/v1model/include/headers.p4, ``((bit<336>)0x.. [<< n])``, as a number."""
    text = V1MODEL_HEADERS.read_text()
    value, shift = re.search(rf"#define {name}\s+\(\(bit<336>\)(0x[0-9a-f]+)(?: << (\d+))?\)", text).groups()
    return int(value, 16) << int(shift or 0)


def test_reply_checksum_steps_give_the_ipv4_checksum():
    """reply_to_sender's steps (aggregation.p4), written out here with headers.p4's masks, on headers whose
    sums fold once, twice or to 0xffff: the checksum of the header as it is, whatever its own checksum said."""
    lanes, but_checksum, ones = (header_mask(n) for n in ("IP_WORD_LANES", "IP_WORD_LANES_BUT_CHECKSUM",
                                                          "IP_WORD_LANE_ONES"))
    assert header_mask("OUTER_IP_CHECKSUM") == 0xFFFF << 128
    rng = random.Random(20)
    headers = [bytes(20), b"\xff" * 20, bytes.fromhex("4500001c000040004011") + bytes(2) + bytes.fromhex("fffe") * 4]
    headers += [rng.randbytes(20) for _ in range(3000)]
    for ip in headers:
        head = int.from_bytes(bytes(14) + ip + bytes(8), "big")  # outer.head: Ethernet, IPv4, UDP
        total = ((head >> 80 & lanes) + (head >> 64 & but_checksum)) * ones >> 128 & 0xFFFFFFFF
        total = (total >> 16) + (total & 0xFFFF)
        checksum = (~(total + (total >> 16)) << 128 & 0xFFFF << 128) >> 128
        assert checksum == ipv4_checksum(ip[:10] + bytes(2) + ip[12:]), ip.hex()


def test_header_only_checksum_steps_keep_the_ipv4_checksum_right():
    """egress.p4's header_only, written out here with headers.p4's masks: a replica's IPv4 header as the control
    plane wrote it (checksum right), K values' bytes fewer in both lengths and its checksum as many more, the
    carry out of 16 bits added back in, on headers whose checksum carries (>= 0xff00) and whose does not."""
    checksum_mask = header_mask("OUTER_IP_CHECKSUM")
    values = 4 * wire.P4_VALUES_PER_PACKET
    lengths = values << 192 | values << 16  # OUTER_VALUES_IN_LENGTHS
    v1model = (P4 / "v1model" / "egress.p4").read_text()
    assert "(bit<336>)(4 * SA_VALUES) << 128" in p4_block(v1model, "action header_only()")
    assert re.search(r"#define OUTER_VALUES_IN_LENGTHS \(\(bit<336>\)\(4 \* SA_VALUES\) << 192 "
                     r"\| \(bit<336>\)\(4 \* SA_VALUES\) << 16\)", V1MODEL_HEADERS.read_text())
    rng = random.Random(21)
    carried = 0
    for _ in range(4000):
        total = rng.randrange(20 + 8 + wire.HEADER_SIZE + values, 0x10000)
        ip = bytearray(rng.randbytes(20))
        ip[0], ip[2:4], ip[10:12] = 0x45, total.to_bytes(2, "big"), bytes(2)
        ip[10:12] = ipv4_checksum(bytes(ip)).to_bytes(2, "big")
        carried += ip[10] == 0xFF
        udp = bytes(4) + (total - 20).to_bytes(2, "big") + bytes(2)
        head = int.from_bytes(bytes(14) + ip + udp, "big")
        checksum = (head & checksum_mask) + (values << 128)
        head = (head & ~checksum_mask) - lengths | (checksum + (checksum >> 16)) & checksum_mask
        out = head.to_bytes(42, "big")
        assert ipv4_checksum(out[14:34]) == 0, ip.hex()
        assert int.from_bytes(out[16:18], "big") == total - values == 20 + int.from_bytes(out[38:40], "big")
    assert carried > 5


def test_one_counter_array_per_job_counter():
    text = (P4 / "v1model" / "aggregation.p4").read_text()
    arrays = re.findall(r"counter<bit<16>>\(SA_NUM_JOB_IDS, CounterType\.packets\)\s+job_(\w+);", text)
    assert arrays == [j.name.lower() for j in JobCounter]


def p4_block(text: str, opening: str) -> str:
    """The body of the block that ``opening`` (up to its ``{``) starts, to its matching ``}``."""
    start = text.index(opening)
    depth, i = 0, text.index("{", start)
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j]
    raise AssertionError(f"{opening} is not closed")


def test_v1model_a_query_writes_no_register():
    """The query path (docs/protocol.md section 5): the tag as the tag stage reads it, then the workers
    register read into the PENDING; no register written, no field of the contribution's path added to."""
    text = (P4 / "v1model" / "aggregation.p4").read_text()
    query = p4_block(text, "action read_tag()") + p4_block(text, "action pending_reply()")
    assert re.findall(r"(\w+)\.read\(", query) == ["tag", "workers"]
    assert ".write(" not in query
    assert "read_tag();" in p4_block(text, "action tag_stage()")  # one test of freshness for both
    assert "SA_QUERY_TO_PENDING" in query and "reply_to_sender();" in query


def test_replica_instances_count_workers_before_on_the_same_port():
    cfg = loopback_job(5)
    ports = [3, 7, 3, 3, 7]
    cfg = dataclasses.replace(cfg, workers=tuple(dataclasses.replace(w, switch_port=p)
                                                 for w, p in zip(cfg.workers, ports, strict=True)))
    assert p4job.replica_instances(cfg) == [0, 0, 1, 2, 1]


def test_deploy_refuses_a_switch_port_the_program_does_not_take():
    cfg = dataclasses.replace(loopback_job(2, values_per_packet=wire.P4_VALUES_PER_PACKET),
                              switch=Endpoint("10.0.0.1", wire.UDP_PORT + 1))
    with pytest.raises(ConfigError, match=f"UDP port {wire.UDP_PORT}"):
        bmv2.Bmv2Target("127.0.0.1:1").deploy(cfg)  # refused before it connects


# The TNA program (p4/tna): its own types against the shared sizes, and the layout docs/tofino.md describes.
TNA = P4 / "tna"
TNA_TYPES = TNA / "include" / "types.p4"


def tna(name: str, trees: bool = False) -> str:
    """A file of p4/tna as the preprocessor gives it with ``SA_TREES`` defined (Tofino 2's build) or not
    (Tofino 1's): the lines of the other branch of each ``#ifdef SA_TREES`` left out, every other line kept."""
    out, keep = [], [True]  # per open conditional: whether its current branch is kept
    kinds: list[bool] = []  # per open conditional: whether it is SA_TREES's
    for line in (TNA / name).read_text().splitlines(keepends=True):
        word = line.strip().split(" ")[0]
        if word in ("#if", "#ifdef", "#ifndef"):
            ours = line.split() == ["#ifdef", "SA_TREES"]
            kinds.append(ours)
            keep.append(keep[-1] and (trees if ours else True))
            if ours:
                continue
        elif word in ("#else", "#endif") and kinds:
            ours = kinds[-1]
            if word == "#else":
                keep[-1] = keep[-2] and (not trees if ours else True)
            else:
                kinds.pop()
                keep.pop()
            if ours:
                continue
        if keep[-1]:
            out.append(line)
    return "".join(out)


def tna_typedefs() -> dict[str, int]:
    text = TNA_TYPES.read_text()
    return {"PortId_t": 9, **{n: int(b) for b, n in re.findall(r"typedef\s+bit<(\d+)>\s+(\w+);", text)}}


def header_width(name: str) -> int:
    """A TNA header's width in bits, padding and typedef'd fields included."""
    body = re.search(r"header\s+" + name + r"\s*\{(.*?)\}", TNA_TYPES.read_text(), re.S).group(1)
    widths = tna_typedefs()
    bits = 0
    for decl in re.findall(r"^\s*(?:@padding\s+)?(bit<\d+>|\w+)\s+\w+;", body, re.M):
        bits += int(decl[4:-1]) if decl.startswith("bit<") else widths[decl]
    return bits


def test_tna_index_widths_hold_the_pool():
    c, t = constants(), tna_typedefs()
    assert 1 << t["copy_index_t"] == c["SA_NUM_COPIES"]
    assert 1 << t["value_index_t"] == 2 * c["SA_NUM_COPIES"]  # both halves of every copy
    assert re.search(r"#define SA_VALUE_CELLS (\d+)", TNA_TYPES.read_text()).group(1) == str(2 * c["SA_NUM_COPIES"])
    assert 1 << t["job_index_t"] == c["SA_MAX_JOBS"]
    assert 1 << t["job_event_t"] == c["SA_JOB_COUNTER_STRIDE"]
    assert t["job_counter_index_t"] == t["job_index_t"] + t["job_event_t"]
    # the register indices: the cell's low log2(SA_NUM_SLOTS) bits ++ copy (++ half)
    cell_bits = c["SA_NUM_SLOTS"].bit_length() - 1
    assert "(md.cell[9:0] ++ hdr.sa.flags[0:0] ++ md.half)" in (TNA / "values.p4").read_text() and cell_bits == 10
    assert "hdr.recirc.cell[9:0] ++ hdr.sa.flags[0:0] : md.cell[9:0] ++ hdr.sa.flags[0:0]" in (
        TNA / "aggregation.p4").read_text()


def test_tna_values_are_halves_of_k():
    fields = header_fields("sa_values_h", TNA_TYPES)
    assert fields == [(f"v{j:02d}", 32) for j in range(wire.P4_VALUES_PER_PACKET // 2)]
    assert "#define SA_VALUES_PER_PASS (SA_VALUES / 2)" in TNA_TYPES.read_text()


def test_tna_recirculation_header_is_whole_bytes():
    """The first pass writes it and the second parses it; the bridge header to egress is @flexible."""
    assert header_width("sa_recirc_h") % 8 == 0
    assert re.search(r"@flexible\s+header sa_bridge_h", TNA_TYPES.read_text())


def test_tna_one_value_register_per_value_four_decided_first():
    """values.p4: one register and one table per value of a half; the first four (a stage's stateful ALUs)
    decide the op themselves, the others run it."""
    text = (TNA / "values.p4").read_text()
    half = wire.P4_VALUES_PER_PACKET // 2
    assert re.findall(r"^\s*SA_VALUE_REGISTER\((\d+)\)", text, re.M) == [f"{j:02d}" for j in range(half)]
    assert re.findall(r"table decide_(\d+) \{", text) == [f"{j:02d}" for j in range(4)]
    assert re.findall(r"^\s*SA_VALUE_TABLE\((\d+)\)", text, re.M) == [f"{j:02d}" for j in range(4, half)]
    applied = re.findall(r"(decide|value)_(\d+)\.apply\(\);", text)
    assert applied == [("decide", f"{j:02d}") for j in range(4)] + [("value", f"{j:02d}") for j in range(4, half)]


def test_tna_a_repeat_is_told_by_each_workers_bit():
    """Both passes' decisions: a worker whose bit the half's bitmap already had sent a repeat."""
    every = [(str(w), str(w), str(w)) for w in range(wire.MAX_WORKERS)]
    first = (TNA / "values.p4").read_text()
    assert re.findall(r"\(0, _, SA_TAG_SAME, 32w1 << (\d+) &&& 32w1 << (\d+), (\d+)\): first_read\(\);", first) == every
    assert re.findall(r"\(0, _, SA_TAG_SAME, 32w1 << (\d+) &&& 32w1 << (\d+), (\d+)\): read; \\", first) == every
    second = (TNA / "aggregation.p4").read_text()
    assert re.findall(r"\(SA_TAG_SAME, 32w1 << (\d+) &&& 32w1 << (\d+), (\d+)\): read\(\);", second) == every


def _params(text: str, action: str) -> list[str]:
    return [p.split()[-1] for p in re.search(rf"action {action}\((.*?)\)", text, re.S).group(1).split(",")]


@pytest.mark.parametrize("trees", [False, True], ids=["tofino", "tofino2 (SA_TREES)"])
def test_tna_control_plane_names(trees):
    """The names docs/tofino.md gives the control plane, and the Tofino target writes, as the source declares
    them, with trees (Tofino 2's build) and without (Tofino 1's)."""
    from switchagg.targets import tofino

    tables = tofino.TREE_TABLES if trees else tofino.TABLES
    admission = tna("admission.p4", trees)
    keys = re.search(r"table admission \{\s*key = \{(.*?)\}", admission, re.S).group(1)
    assert tuple(re.findall(r'@name\("(\w+)"\)', keys)) == tables[tofino.ADMISSION][0]
    actions = tables[tofino.ADMISSION][1]
    assert tuple(_params(admission, "admit")) == actions[tofino.ADMIT]
    assert (tuple(_params(admission, "admit_result")) == actions[tofino.ADMIT_RESULT]) if trees else (
        "admit_result" not in admission and tofino.ADMIT_RESULT not in actions)
    egress = tna("egress.p4", trees)
    assert 'eg_intr_md.egress_rid: exact @name("rid")' in egress
    for action, params in tables[tofino.REPLICA][1].items():
        assert tuple(_params(egress, action.split(".")[-1])) == params
    assert ("to_parent" in egress) == trees
    assert 'hdr.ethernet.dst_addr: exact @name("eth_dst")' in (TNA / "forwarding.p4").read_text()
    assert "value_set<PortId_t>(4) recirculation_ports;" in (TNA / "parser.p4").read_text()
    main = (TNA / "main.p4").read_text()
    assert "Counter<bit<32>, bit<8>>(SA_NUM_GLOBAL_DROPS, CounterType_t.PACKETS) global_drops;" in main
    assert "(SA_MAX_JOBS * SA_JOB_COUNTER_STRIDE, CounterType_t.PACKETS) job_counters;" in main


def test_tna_a_query_only_reads_the_first_half():
    """A query's RegisterActions (aggregation.p4) write nothing, the second half runs none of them, and
    its verdicts are tags no decision of the values matches (values.p4), so its op stays NONE."""
    text = tna("aggregation.p4")
    for name in ("tag_generation_peek", "tag_chunk_peek", "workers_read"):
        body = p4_block(text, f") {name} = {{")
        assert not re.search(r"\bvalue\s*=(?!=)", body), name
    apply = p4_block(text[text.index("control CopyState"):], "    apply {")
    assert re.findall(r"!second_half && md\.tag == (\w+)\) \{\s*(\w+)\(\);", apply) == [
        ("SA_TAG_PEEK", "peek_chunk"), ("SA_TAG_HELD", "read_workers")]
    assert "(1, _, _, 1): peek_generation();" in text and "(1, _, _, 0): check_generation();" in text
    types = tna("include/types.p4")
    tags = {n: int(v) for n, v in re.findall(r"const bit<8> (SA_TAG_\w+) = (\d+);", types)}
    assert len(set(tags.values())) == len(tags) == 7
    values = tna("values.p4")
    assert set(re.findall(r"\(0, _, (SA_TAG_\w+),", values)) == {"SA_TAG_FRESH", "SA_TAG_SAME"}
    exponent = p4_block(text, "table exponent_op {")
    assert set(re.findall(r"\((SA_TAG_\w+),", exponent)) == {"SA_TAG_FRESH", "SA_TAG_SAME"}


def test_a_packet_of_any_generation_but_zero_is_taken():
    """docs/protocol.md section 7, item 5, on both programs: generation 0 (what every tag powers up holding) is
    wrong_generation, in the model's order (after a probe's answer, before the slot check); any other is a run's
    session generation, never compared with the job's installed one, which only a probe's reply carries."""
    v1model = (P4 / "v1model" / "aggregation.p4").read_text()
    apply = p4_block(v1model, "    apply {")
    assert apply.lstrip().startswith("if (hdr.vals.isValid() && hdr.sa.chunk_generation & SA_GENERATION_BITS != 0")
    steps = re.findall(r"\} else if \((.*?)\) \{\s*(?:/\*.*?\*/\s*)?(\w+)\(\);", apply)
    probe = [step[1] for step in steps].index("probe_reply")  # the first test off the common path
    assert steps[probe:probe + 3] == [
        ("hdr.sa.version_type_flags_worker & SA_TYPE_BITS == (bit<32>)SA_TYPE_PROBE << 16", "probe_reply"),
        ("hdr.sa.chunk_generation & SA_GENERATION_BITS == 0", "drop_wrong_generation"),
        ("hdr.sa.slot >= hdr.local.job[63:48]", "drop_slot_out_of_range")]
    uses = [m.start() for m in re.finditer(r"hdr\.local\.job & SA_GENERATION_BITS", v1model)]
    reply = v1model.index("action probe_reply()")
    assert len(uses) == 1 and reply < uses[0] < v1model.index("}", reply)  # the job's: the probe's reply only

    aggregation = tna("aggregation.p4")
    entries = re.findall(r"\(([^()]*)\): (\w+)\(\);", p4_block(aggregation, "table admitted {"))
    assert entries == [("1, 0, _, _", "wrong_generation"), ("1, _, 0, _", "slot_out_of_range"),
                       ("1, _, _, 0", "check_generation"), ("1, _, _, 1", "peek_generation")]  # tried in order
    assert "const default_action = drop_not_admitted();" in p4_block(aggregation, "table admitted {")
    assert "hdr.sa.generation: ternary;" in p4_block(aggregation, "table admitted {")
    trees = re.findall(r"\(([^()]*)\): (\w+)\(\);", p4_block(tna("aggregation.p4", True), "table admitted {"))
    assert trees == [("1, 0, _, _, _", "wrong_generation"), ("1, _, 0, _, _", "slot_out_of_range"),
                     ("1, _, _, 0, 0", "check_generation"), ("1, _, _, _, _", "peek_generation"),
                     ("0, _, _, _, 1", "drop_malformed")]  # a parent's RESULT: the query's read, or malformed
    main = tna("main.p4")
    assert re.search(r"hdr\.sa\.type == SA_TYPE_PROBE\) \{\s*probe_reply\(\);\s*"
                     r"\} else if \(hdr\.sa\.generation == 0\) \{[^\n]*\n\s*drop_job\(SA_JOB_WRONG_GENERATION\);", main)
    assert "hdr.sa.generation" not in p4_block((TNA / "admission.p4").read_text(), "action admit(")


def test_an_owner_is_checked_after_the_slot_and_before_the_count():
    """docs/protocol.md section 7: an owner that is not one of the job's ranks is bad_owner, after the slot check
    and before the count's (and a query's answer), on the contribution's path and off it (v1model; the TNA
    program has no owner-only delivery yet: docs/tofino.md)."""
    v1model = p4_block((P4 / "v1model" / "aggregation.p4").read_text(), "    apply {")
    assert v1model.lstrip().startswith(
        "if (hdr.vals.isValid() && hdr.sa.chunk_generation & SA_GENERATION_BITS != 0\n"
        "                && hdr.sa.slot < hdr.local.job[63:48] && hdr.sa.owner_count < hdr.local.owners)")
    steps = [step[1] for step in re.findall(r"\} else if \((.*?)\) \{\s*(?:/\*.*?\*/\s*)?(\w+)\(\);", v1model)]
    assert steps[steps.index("drop_slot_out_of_range"):][:3] == ["drop_slot_out_of_range", "drop_bad_owner", "read_tag"]



def test_the_v1model_tree_constants_are_the_control_planes():
    """What admission and the job's parameters hold for a tree (docs/protocol.md section 10), as bmv2.py and
    p4job.py write them: the parent flag's place in the packed job, the owner limit's, and type bit 0, which a
    worker's admission entry holds 1 and a parent's 0 (a RESULT alone has 0 among the types validation passes)."""
    from switchagg.targets import bmv2

    metadata = (P4 / "v1model" / "include" / "metadata.p4").read_text()
    defines = {n: int(v, 16) for n, v in re.findall(r"#define (LOCAL_\w+)\s+64w(0x[0-9a-f]+)", metadata)}
    assert defines["LOCAL_PARENT"] == p4job.PARENT_FLAG << 40
    params = p4job.JobParams(4, 3, 2, p4job.owners(300), parent=True)
    assert params.pack() & defines["LOCAL_PARENT"] and params.pack() & defines["LOCAL_OWNERS"] == 0xFFFFFF
    assert p4job.JobParams.unpack(params.pack()) == params and p4job.owners(9) == 9 << 16
    bit = re.search(r"#define SA_TYPE_BIT_0\s+32w(0x[0-9a-f]+)", V1MODEL_HEADERS.read_text()).group(1)
    assert int(bit, 16) == bmv2.TYPE_BIT_0 == 1 << 16
    assert [t for t in (wire.PacketType.CONTRIB, wire.PacketType.PROBE, wire.PacketType.QUERY,
                        wire.PacketType.RESULT) if not t & 1] == [wire.PacketType.RESULT]


def test_tna_a_parent_s_result_starts_no_copy():
    """With trees (docs/tofino.md, "Trees"), a parent's RESULT reads the tag in both halves with the query's
    read-only actions, and its one write, the parent's bit, is where the half holds exactly the children: it
    never starts a copy nor completes one that lacks a child. Its taken tag is the only new one a decision
    matches, and it writes (replace: the values and the exponent), never adds."""
    text = tna("aggregation.p4", True)
    apply = p4_block(text[text.index("control CopyState"):], "    apply {")
    assert re.search(r"\} else if \(md\.result == 1\) \{[^\n]*\n\s*peek_generation\(\);", apply)
    assert re.search(r"\} else if \(md\.tag == SA_TAG_PEEK\) \{[^\n]*\n\s*peek_chunk\(\);", apply)
    assert re.search(r"md\.tag == SA_TAG_HELD && md\.result == 1\) \{[^\n]*\n\s*take_workers\(\);", apply)
    take = p4_block(text, ") workers_take = {")
    assert re.findall(r"\bvalue\s*=(?!=)[^;]*;", take) == ["value = value | md.worker_bit;"]
    assert take.index("if (value == md.other_workers) {") < take.index("value = value | md.worker_bit;")
    values = tna("values.p4", True)
    assert set(re.findall(r"\(0, _, (SA_TAG_\w+),", values)) == {"SA_TAG_FRESH", "SA_TAG_SAME", "SA_TAG_TAKE"}
    assert "#define SA_DECIDE_TAKEN(write) (0, _, SA_TAG_TAKE, 1, _): write;" in values  # every decide_NN
    assert "SA_DECIDE_TAKEN(write) \\\n" in values
    assert "SA_DECIDE_TAKEN(first_write())" in p4_block(values, "table decide_00")
    assert "#define SA_DECIDE_TAKEN(write)\n" in tna("values.p4")  # none without trees
    exponent = p4_block(text, "table exponent_op {")
    assert re.findall(r"\(SA_TAG_TAKE, 1, _\): (\w+)\(\);", exponent) == ["replace"]
    assert "md.workers_missing = 0;" in p4_block(text, "action replace()")
