"""A job file that is wrong in any way is refused with a message that names the field and what to write."""

from __future__ import annotations

import sys
import tomllib

import pytest

from switchagg import ConfigError, Endpoint, JobConfig, WorkerSpec

GOOD = """
[switch]
address = "127.0.0.1:16711"
control = "127.0.0.1:16712"

[job]
id = 1
key = 0x5eed
{job}

[[workers]]
address = "127.0.0.1:40000"
{worker}

[[workers]]
address = "127.0.0.1:40001"
{extra}
"""


def parse(job: str = "", worker: str = "", extra: str = "") -> JobConfig:
    return JobConfig.from_dict(tomllib.loads(GOOD.format(job=job, worker=worker, extra=extra)))


def refused(match: str, **parts: str) -> str:
    with pytest.raises(ConfigError, match=match) as info:
        parse(**parts)
    return str(info.value)


def test_a_good_file_reads_and_writes_back_unchanged(tmp_path):
    cfg = parse(job="values_per_packet = 64\nloss_recovery = \"query\"\ngeneration = 5",
                worker='mac = "02:5a:00:00:00:01"\nswitch_port = 3')
    assert cfg.workers[0].mac == "02:5a:00:00:00:01" and cfg.workers[0].switch_port == 3
    assert JobConfig.from_file(cfg.write(tmp_path / "job.toml")) == cfg


@pytest.mark.parametrize(("parts", "message"), [
    ({"job": "valeus_per_packet = 8"}, "job.valeus_per_packet is not a known key: did you mean values_per_packet?"),
    ({"job": "slot_cout = 8"}, "job.slot_cout is not a known key: did you mean slot_count?"),
    ({"job": "loss_recovry = \"query\""}, "job.loss_recovry is not a known key: did you mean loss_recovery?"),
    ({"worker": "adress = \"127.0.0.1:5\""}, "workers[0].adress is not a known key: did you mean address?"),
    ({"worker": "switchport = 3"}, "workers[0].switchport is not a known key: did you mean switch_port?"),
    ({"extra": "[jobs]\nid = 2"}, "[jobs] is not a known table: did you mean [job]?"),
    ({"extra": "[bmv2]\ngrpc = 1"}, "[bmv2] is not a known table: the tables are [switch], [job], [[workers]]"),
    ({"job": "zzz = 1"}, "job.zzz is not a known key: the keys there are id, key, slot_base"),
])
def test_unknown_keys_and_tables_name_the_nearest_known_one(parts, message):
    """A typo used to be ignored, leaving the default in force (valeus_per_packet = 8 gave K = 64)."""
    assert message in refused(".", **parts)


def test_a_key_above_every_table_is_told_where_it_belongs():
    with pytest.raises(ConfigError, match=r"values_per_packet = 8 stands outside every table: move it under \[job\]"):
        JobConfig.from_dict(tomllib.loads("values_per_packet = 8\n" + GOOD.format(job="", worker="", extra="")))


def test_the_switch_table_s_keys_are_checked_too():
    with pytest.raises(ConfigError, match="switch.contrl is not a known key: did you mean control?"):
        JobConfig.from_dict(tomllib.loads(GOOD.replace("control =", "contrl =").format(job="", worker="", extra="")))


@pytest.mark.parametrize(("job", "message"), [
    ("values_per_packet = 0", r"job.values_per_packet = 0: it must be an integer in 1..16370"),  # ZeroDivisionError
    ("values_per_packet = -4", r"job.values_per_packet = -4: it must be an integer in 1..16370"),
    ("values_per_packet = 64.0", r"job.values_per_packet = 64.0: it must be an integer"),
    ("values_per_packet = true", r"job.values_per_packet = True: it must be an integer"),
    ("values_per_packet = \"64\"", r"job.values_per_packet = '64': it must be an integer"),
    ("slot_count = 0", r"job.slot_count = 0: it must be an integer in 1..65535"),
    ("slot_base = -1", r"job.slot_base = -1"),
    ("generation = 0", r"job.generation = 0"),
    ("loss_recovery = [\"query\"]", r"job.loss_recovery = \['query'\]: use one of"),  # was a TypeError
])
def test_every_job_field_is_range_and_type_checked_before_use(job, message):
    refused(message, job=job)


@pytest.mark.parametrize(("worker", "message"), [
    ("mac = 5", r"workers\[0\].mac = 5: write six hex bytes"),
    ("mac = \"02:5a:00:00:01\"", r"workers\[0\].mac = '02:5a:00:00:01': write six hex bytes"),
    ("mac = \"02-5a-00-00-00-01\"", r"workers\[0\].mac = '02-5a-00-00-00-01': write six hex bytes"),
    ("mac = \"ff:ff:ff:ff:ff:ff\"", r"is a multicast address: give the device's own \(unicast\)"),
    ("switch_port = 512", r"workers\[0\].switch_port = 512: it must be an integer in 0..511"),
    ("switch_port = -1", r"workers\[0\].switch_port = -1"),
    ("switch_port = \"3\"", r"workers\[0\].switch_port = '3'"),
    ("switch_port = true", r"workers\[0\].switch_port = True"),
])
def test_the_p4_targets_worker_fields_are_checked_where_given(worker, message):
    refused(message, worker=worker)


@pytest.mark.parametrize(("text", "message"), [
    ('address = 16711', r"switch.address = 16711: write it as a string 'IPv4:port'"),
    ('address = "127.0.0.1:¹⁶⁷¹¹"', r"write it as 'IPv4:port'"),  # str.isdigit() takes superscripts; int() not
    ('address = "127.0.0.1:0"', r"the port must be 1..65535"),
    ('control = ""', r"switch.control = '': write it as 'IPv4:port'"),
])
def test_addresses_are_checked(text, message):
    key = text.split(" ")[0]
    doc = GOOD.replace(f'{key} = "127.0.0.1:{16711 if key == "address" else 16712}"', text)
    with pytest.raises(ConfigError, match=message):
        JobConfig.from_dict(tomllib.loads(doc.format(job="", worker="", extra="")))


def test_tables_of_the_wrong_shape_are_refused_not_crashed_on():
    with pytest.raises(ConfigError, match=r"workers\[0\] = 5: each worker is a \[\[workers\]\] table"):
        JobConfig.from_dict({"switch": {"address": "127.0.0.1:1"}, "job": {"id": 1, "key": 1}, "workers": [5]})
    with pytest.raises(ConfigError, match=r"job = 5: \[job\] is a table"):
        JobConfig.from_dict({"switch": {"address": "127.0.0.1:1"}, "job": 5, "workers": [{"address": "1.2.3.4:5"}]})
    with pytest.raises(ConfigError, match=r"the \[switch\] table is missing"):
        JobConfig.from_dict({"job": {"id": 1, "key": 1}, "workers": [{"address": "1.2.3.4:5"}]})


def workers(n: int) -> tuple[WorkerSpec, ...]:
    return tuple(WorkerSpec(Endpoint("127.0.0.1", 40000 + r)) for r in range(n))


def test_the_slots_hold_the_chunks_of_two_words_per_rank():
    """Each call's first packets carry a call descriptor for every rank, two words each, in as many chunks
    of K as they fill, a slot each (and the join's sums its nonces so): a job needs that many slots."""
    with pytest.raises(ConfigError) as info:
        JobConfig(Endpoint("127.0.0.1", 16711), 1, 1, 0, 1, 9, workers(5))
    assert str(info.value) == ("job.slot_count = 1 is below the 2 chunks of K = 9 values that two values per "
                               "rank take for 5 ranks (each call's first packets carry them, a slot each): "
                               "use slot_count >= 4, or values_per_packet >= 10 and slot_count >= 2")
    assert JobConfig(Endpoint("127.0.0.1", 16711), 1, 1, 0, 4, 9, workers(5)).slot_count == 4
    assert JobConfig(Endpoint("127.0.0.1", 16711), 1, 1, 0, 2, 10, workers(5)).values_per_packet == 10
    # the P4 program's K = 64 holds the most workers a job may have in one chunk
    assert JobConfig(Endpoint("127.0.0.1", 16711), 1, 1, 0, 2, 64, workers(32)).n_workers == 32
    refused(r"job.slot_count = 1 is below the 2 chunks of K = 3 values", job="values_per_packet = 3\nslot_count = 1")


@pytest.mark.parametrize("slots, k, fix", [(1, 64, r"use slot_count >= 2$"), (3, 9, r"use slot_count >= 4, or "
                                                                                     r"values_per_packet >= 10$")])
def test_the_slots_hold_two_blocks_of_the_joins_rungs(slots, k, fix):
    """The join climbs rungs of a call round's chunks, a block of slots each, and a run that climbed closes on
    block 0; with one block every rung replaced the first's copies, and a rank ahead could strand its peers
    wherever a run climbed (docs/protocol.md 6a): a job of fewer than two blocks is refused, saying what fixes it."""
    with pytest.raises(ConfigError, match=rf"job.slot_count = {slots} holds one block of the .* the join needs two.*"
                                          + fix):
        JobConfig(Endpoint("127.0.0.1", 16711), 1, 1, 0, slots, k, workers(5))
    assert JobConfig(Endpoint("127.0.0.1", 16711), 1, 1, 0, 2 * -(-10 // k), k, workers(5)).slot_count >= 2


def test_a_config_built_in_python_is_checked_as_one_read_from_a_file():
    with pytest.raises(ConfigError, match=r"workers\[1\].mac = 'nope'"):
        JobConfig(Endpoint("127.0.0.1", 16711), 1, 1, 0, 16, 64,
                  (WorkerSpec(Endpoint("127.0.0.1", 1)), WorkerSpec(Endpoint("127.0.0.1", 2), mac="nope")))
    with pytest.raises(ConfigError, match="switch.address = '127.0.0.1:16711': give an Endpoint"):
        JobConfig("127.0.0.1:16711", 1, 1, 0, 16, 64, workers(1))


@pytest.mark.parametrize(("content", "message"), [
    (GOOD.format(job="", worker="", extra="# caf\xe9").encode("latin-1"),
     r"is not UTF-8 text \(byte \d+: invalid continuation byte\): save it as UTF-8"),
    (GOOD.format(job="", worker="", extra="nested = " + "[" * 1000 + "]" * 1000).encode(),
     "nests arrays or tables too deep to read.*remove the nesting"),
    (GOOD.format(job="", worker="", extra="nested = " + "{a = " * 1000 + "1" + "}" * 1000).encode(),
     "nests arrays or tables too deep to read"),
    (GOOD.format(job="slot_base = " + "9" * 5000, worker="", extra="").encode(),
     "holds a number too long to read .*fits in 32 bits; shorten it"),
    # TOML's hex, octal and binary integers are read whole (Python limits only the decimal digits it
    # converts), and then could not be written into the message that names them
    (GOOD.format(job="slot_base = 0x" + "1" * 5000, worker="", extra="").encode(),
     "holds a number too long to read .*fits in 32 bits; shorten it"),
    (GOOD.format(job="", worker="switch_port = [0o" + "7" * 6000 + "]", extra="").encode(),
     "holds a number too long to read"),
], ids=["latin-1", "nested-arrays", "nested-tables", "5000-digits", "5000-hex-digits", "octal-in-an-array"])
def test_a_file_the_parser_cannot_read_is_one_line_saying_what_to_fix(tmp_path, content, message):
    path = tmp_path / "job.toml"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=message) as info:
        JobConfig.from_file(path)
    assert str(info.value).startswith(f"job file {path} ") and "\n" not in str(info.value)


@pytest.mark.parametrize("limit", [1000, 3000], ids=["default", "raised"])
@pytest.mark.parametrize("levels", [20, 1000])
def test_nesting_is_refused_alike_whatever_the_interpreters_recursion_limit(tmp_path, limit, levels):
    """The parser stops at the recursion limit, which a program may have raised (importing IPython, as the P4
    targets' p4runtime-shell does, raises it to 3000): nesting past MAX_NESTING is refused either way."""
    path = tmp_path / "job.toml"
    path.write_bytes(GOOD.format(job="", worker="", extra="nested = " + "[" * levels + "]" * levels).encode())
    before = sys.getrecursionlimit()
    sys.setrecursionlimit(limit)
    try:
        with pytest.raises(ConfigError, match="nests arrays or tables too deep to read"):
            JobConfig.from_file(path)
    finally:
        sys.setrecursionlimit(before)


def test_a_path_that_is_not_a_readable_file_says_so(tmp_path):
    with pytest.raises(ConfigError, match=f"cannot read job file {tmp_path}: Is a directory; give a readable file"):
        JobConfig.from_file(tmp_path)
