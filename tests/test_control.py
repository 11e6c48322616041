"""The embedded switch's control port is safe to leave running: loopback unless asked, changes need the
job's key, every bad request gets an error reply (never a dropped connection), no global patching."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import socketserver
import threading

import pytest

from switchagg import ConfigError, SoftSwitch
from switchagg.config import Endpoint
from switchagg.errors import SwitchAggError
from switchagg.jobs import Lease, lapsed, lapsed_jobs
from switchagg.loopback import free_ports, loopback_job
from switchagg.switch.control import MAX_REQUEST, TOKEN_ENV, ControlServer, Guard, control_token
from switchagg.switch.control_client import request
from switchagg.targets import TargetOptions, open_target
from switchagg.targets.base import UnsupportedOperation
from switchagg.transport import BATCHED_AVAILABLE
from switchagg.wire import PacketType, make_header, unpack_header


def control_of(sw: SoftSwitch) -> Endpoint:
    return Endpoint(*sw.control_address)


@pytest.fixture(params=[1, 2] if BATCHED_AVAILABLE else [1], ids=lambda cores: f"{cores}-core")
def soft_switch(request):
    """conftest's switch, on one core and on two: the control port serves both alike."""
    (control,) = free_ports(1, socket.SOCK_STREAM)
    sw = SoftSwitch(("127.0.0.1", 0), control=("127.0.0.1", control), cores=request.param).start()
    yield sw
    sw.stop()
    assert sw.error is None


def test_status_says_the_cores_and_what_each_served(make_job, soft_switch):
    cfg = make_job(2, k=64)
    probe = make_header(PacketType.PROBE, job=cfg.job_id, worker=0, key=cfg.key).pack()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as rank0:
        rank0.bind(cfg.workers[0].address.tuple)
        rank0.sendto(probe, soft_switch.address)
        assert unpack_header(rank0.recv(100)).type == PacketType.PROBE_REPLY
    status = request(control_of(soft_switch), {"op": "status"})
    assert status["cores"] == soft_switch.cores and len(status["shards"]) == soft_switch.cores
    assert sum(s["datagrams"] for s in status["shards"]) == 1 == status["counters"]["jobs"]["1"]["probes"]
    assert all(s["off_home"] == 0 for s in status["shards"])


def test_the_control_port_refuses_an_address_other_than_loopback_unless_told(soft_switch):
    (port,) = free_ports(1, socket.SOCK_STREAM)
    for host in ("0.0.0.0", "10.1.2.3"):
        with pytest.raises(ConfigError, match=r"not loopback.*--control-any-address.*control_public=True"):
            SoftSwitch(("127.0.0.1", 0), control=(host, port))
        with pytest.raises(ConfigError, match="not loopback"):
            ControlServer((host, port), soft_switch)
    with SoftSwitch(("127.0.0.1", 0), control=("0.0.0.0", port), control_public=True, control_token="t") as sw:
        assert request(Endpoint("127.0.0.1", port), {"op": "status"})["address"] == list(sw.address)
    with SoftSwitch(("127.0.0.1", 0), control=("localhost", 0)) as sw:  # a name that resolves to loopback
        assert request(control_of(sw), {"op": "status"})["jobs"] == {}


def test_reset_and_remove_need_the_installed_job_s_key_and_reads_need_none(make_job, soft_switch):
    cfg = make_job(2, k=64)
    control = control_of(soft_switch)
    generation = soft_switch.jobs()[cfg.job_id].generation
    for op in ("reset", "renew", "remove_job"):
        with pytest.raises(ConfigError, match=f"{op} of job 1 needs 'key'"):
            request(control, {"op": op, "job": cfg.job_id})
        with pytest.raises(ConfigError, match="'key' is not job 1's key"):
            request(control, {"op": op, "job": cfg.job_id, "key": cfg.key ^ 1})
        with pytest.raises(ConfigError, match="needs 'key'"):
            request(control, {"op": op, "job": cfg.job_id, "key": str(cfg.key)})
    assert soft_switch.jobs()[cfg.job_id].generation == generation  # nothing changed
    assert str(cfg.job_id) in request(control, {"op": "status"})["jobs"]
    assert set(request(control, {"op": "slots", "job": cfg.job_id, "slots": [0, 1]})["slots"]) == {"0", "1"}
    new = request(control, {"op": "reset", "job": cfg.job_id, "key": cfg.key})["generation"]
    assert new != generation and soft_switch.jobs()[cfg.job_id].generation == new
    assert request(control, {"op": "remove_job", "job": cfg.job_id, "key": cfg.key}) == {}
    assert cfg.job_id not in soft_switch.jobs()
    with pytest.raises(ConfigError, match="job 1 is not installed on this switch"):
        request(control, {"op": "reset", "job": cfg.job_id, "key": cfg.key})


def test_add_job_takes_the_key_of_the_config_it_carries_and_never_replaces_an_installed_job(
        make_job, soft_switch):
    cfg = make_job(2, k=64)
    control = control_of(soft_switch)
    with pytest.raises(ConfigError, match="job 1 is already installed"):
        request(control, {"op": "add_job", "config": cfg.to_toml()})
    other = dataclasses.replace(cfg, job_id=2, slot_base=2048)
    with pytest.raises(ConfigError, match="'key' differs from the key in 'config'"):
        request(control, {"op": "add_job", "config": other.to_toml(), "key": other.key ^ 1})
    assert 2 not in soft_switch.jobs()
    assert request(control, {"op": "add_job", "config": other.to_toml(), "key": other.key})["generation"]
    assert soft_switch.jobs()[2].key == other.key


def test_every_bad_request_gets_an_error_reply_and_the_connection_stays_open(make_job, soft_switch):
    """A `slots` request past the switch's size used to drop the connection without a reply (an
    IndexError the handler did not catch); every other malformed request gets a reply too."""
    cfg = make_job(2, k=64)
    bad = [
        {"op": "slots", "job": cfg.job_id, "slots": [10_000_000]},  # past the switch's registers
        {"op": "slots", "job": cfg.job_id, "slots": [cfg.slot_count]},  # past the job's: another job's registers
        {"op": "slots", "job": cfg.job_id, "slots": [-1]},
        {"op": "slots", "job": cfg.job_id, "slots": "0"},
        {"op": "slots", "job": cfg.job_id, "slots": [0.5]},
        {"op": "slots", "job": cfg.job_id},
        {"op": "slots", "job": 99, "slots": [0]},
        {"op": "slots", "job": "1", "slots": [0]},
        {"op": "slots", "job": 1e300, "slots": [0]},
        {"op": "reset"},
        {"op": "reset", "job": None, "key": cfg.key},
        {"op": "remove_job", "job": [1], "key": cfg.key},
        {"op": "add_job"},
        {"op": "add_job", "config": 5},
        {"op": "add_job", "config": "this is not TOML"},
        {"op": "add_job", "config": cfg.to_toml().replace("values_per_packet", "valeus_per_packet")},
        {"op": "add_job", "config": "a = " + "[" * 1000 + "]" * 1000},  # deeper than the TOML parser recurses
        {"op": "add_job", "config": cfg.to_toml().replace("[job]", "[job]\nslot_base = " + "9" * 5000)},
        {"op": "frobnicate"},
        {},
    ]
    lines = [json.dumps(r).encode() for r in bad] + [
        b"not json", b"[1, 2, 3]", b"42", b'"status"', b"null", b"\xff\xfe\xfd", b"", b'{"op": "slots", "job": 1e400}',
        b"[" * 100_000 + b"]" * 100_000, b'{"op": "status", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}",
        b'{"op": "slots", "job": ' + b"1" * 5000 + b"}"]
    with socket.create_connection(soft_switch.control_address, timeout=5) as conn:
        stream = conn.makefile("rwb")
        for line in lines:
            stream.write(line + b"\n")
            stream.flush()
            reply = stream.readline()
            assert reply, f"the connection was dropped after {line!r}"
            assert set(json.loads(reply)) == {"error"}, (line, reply)
        stream.write(b'{"op": "status"}\n')
        stream.flush()
        assert str(cfg.job_id) in json.loads(stream.readline())["jobs"]  # the same connection still serves
    errors = {}
    for r in bad[:2]:
        with pytest.raises(ConfigError) as info:
            request(control_of(soft_switch), r)
        errors[str(r["slots"])] = str(info.value)
    assert f"outside job 1's slots 0..{cfg.slot_count - 1}" in errors["[10000000]"]
    assert soft_switch.error is None


def test_a_request_line_too_long_to_hold_a_job_gets_an_error_before_the_connection_closes(soft_switch):
    with socket.create_connection(soft_switch.control_address, timeout=5) as conn:
        conn.sendall(b"x" * (MAX_REQUEST + 10) + b"\n")
        reply = conn.makefile("rb").readline()
    assert "at most" in json.loads(reply)["error"]


def test_nothing_patches_the_standard_library(soft_switch):
    """The old server set allow_reuse_address on socketserver.ThreadingTCPServer for the whole process."""
    assert "allow_reuse_address" not in vars(socketserver.ThreadingTCPServer)
    assert socketserver.ThreadingTCPServer.allow_reuse_address is False
    # the control port's own server still reuses its address, so a restarted switch binds at once
    server = soft_switch._control._server
    assert server.socket.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR)
    port = soft_switch.control_address[1]
    soft_switch.stop()
    with SoftSwitch(("127.0.0.1", 0), control=("127.0.0.1", port)) as again:
        assert again.control_address[1] == port


def test_a_busy_control_port_says_which_address(soft_switch):
    port = soft_switch.control_address[1]
    with pytest.raises(OSError, match=f"cannot listen for control requests on TCP 127.0.0.1:{port}"):
        SoftSwitch(("127.0.0.1", 0), control=soft_switch.control_address).start()


def test_the_soft_target_sends_the_job_s_key_with_every_change(make_job, soft_switch):
    cfg = make_job(2, k=64)
    target = open_target("soft", TargetOptions(config=cfg))
    generation = soft_switch.jobs()[cfg.job_id].generation
    assert target.reset(cfg.job_id) != generation
    target.undeploy(cfg.job_id)
    assert cfg.job_id not in soft_switch.jobs()
    assert target.deploy(cfg) == soft_switch.jobs()[cfg.job_id].generation
    # opened by address alone, it has no key to send: it says so rather than send none
    bare = open_target("soft", TargetOptions(address=f"127.0.0.1:{soft_switch.control_address[1]}"))
    with pytest.raises(ConfigError, match="resetting job 1 on the embedded switch needs the job's key"):
        bare.reset(cfg.job_id)
    assert bare.status(cfg.job_id).installed


@pytest.mark.parametrize(("options", "message"), [
    ({"device_id": 0}, "--device-id: the embedded switch has no device id"),
    ({"pipeline": "build/bmv2"}, "--pipeline: the embedded switch runs no P4 program"),
])
def test_the_soft_target_refuses_options_it_has_no_use_for(make_job, options, message):
    cfg = make_job(2, k=64)
    with pytest.raises(ConfigError, match=message):
        open_target("soft", TargetOptions(config=cfg, **options))


def test_a_job_re_added_with_its_generation_and_another_k_leaves_the_switch_serving(make_job, soft_switch):
    """Pinned generation, undeploy, change K, redeploy: the first packet used to end the switch's serving thread
    (add_be: the old chunk's values of the other K taken as the new job's)."""
    cfg = dataclasses.replace(make_job(2, k=64), generation=77)
    soft_switch.remove_job(cfg.job_id)
    control = control_of(soft_switch)
    ranks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(2)]
    try:
        for rank, (sock, k) in enumerate(zip(ranks, (64, 128), strict=True)):  # a peer's contribution adds
            sock.bind(cfg.workers[rank].address.tuple)
            sock.settimeout(10)
            request(control, {"op": "add_job", "config": dataclasses.replace(cfg, values_per_packet=k).to_toml()})
            contrib = make_header(PacketType.CONTRIB, job=cfg.job_id, worker=rank, chunk=3, generation=77,
                                  key=cfg.key, count=k).pack() + bytes(4 * k)
            sock.sendto(contrib, soft_switch.address)
            # the probe is served after the contribution: its reply says the switch took that one
            sock.sendto(make_header(PacketType.PROBE, job=cfg.job_id, worker=rank, key=cfg.key).pack(),
                        soft_switch.address)
            assert unpack_header(sock.recv(100)).type == PacketType.PROBE_REPLY
            if k == 64:
                request(control, {"op": "remove_job", "job": cfg.job_id, "key": cfg.key})
    finally:
        for sock in ranks:
            sock.close()
    assert soft_switch.error is None
    assert soft_switch.slot_state(cfg.job_id, [0])[0][0] == {"copy": 0, "generation": 77, "chunk": 3, "bitmap": 2,
                                                             "count": 1}


TOKEN = "s3cret-token"


def test_off_loopback_the_control_port_needs_a_token_and_add_job_carries_it(make_job, monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    (port,) = free_ports(1, socket.SOCK_STREAM)
    with pytest.raises(ConfigError, match=f"not loopback, with no control token.*{TOKEN_ENV}.*--control-token-file"):
        SoftSwitch(("127.0.0.1", 0), control=("0.0.0.0", port), control_public=True)
    with SoftSwitch(("127.0.0.1", 0), control=("0.0.0.0", port), control_public=True, control_token=TOKEN) as sw:
        control = Endpoint("127.0.0.1", port)
        cfg = loopback_job(2, values_per_packet=64, slot_count=16, switch_port=sw.address[1], control_port=port)
        for token, message in ((None, "add_job needs 'token'"), ("guess", "'token' is not this switch's")):
            with pytest.raises(ConfigError, match=message):
                request(control, {"op": "add_job", "config": cfg.to_toml()}, token=token)
        assert sw.jobs() == {}
        assert request(control, {"op": "add_job", "config": cfg.to_toml()}, token=TOKEN)["generation"]
        sw.remove_job(cfg.job_id)
        # what every client sends where the variable is set: the CLI, the soft target, the torch backend's rendezvous
        monkeypatch.setenv(TOKEN_ENV, TOKEN)
        assert open_target("soft", TargetOptions(config=cfg)).deploy(cfg) == sw.jobs()[cfg.job_id].generation
        status = open_target("soft", TargetOptions(config=cfg)).status(cfg.job_id)
        assert status.host_counters["control_auth_failures"] == 2


def test_on_loopback_a_token_is_optional_but_required_once_set(make_job, monkeypatch, tmp_path):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    assert control_token() is None
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    assert control_token(path) == TOKEN
    monkeypatch.setenv(TOKEN_ENV, "from-the-variable")
    assert control_token() == "from-the-variable" and control_token(path) == TOKEN  # the file wins
    path.write_text("")
    with pytest.raises(ConfigError, match="is empty: write the token in it"):
        control_token(path)
    monkeypatch.delenv(TOKEN_ENV)
    (port,) = free_ports(1, socket.SOCK_STREAM)
    with SoftSwitch(("127.0.0.1", 0), control=("127.0.0.1", port), control_token=TOKEN) as sw:
        cfg = loopback_job(2, values_per_packet=64, slot_count=16, switch_port=sw.address[1], control_port=port)
        with pytest.raises(ConfigError, match="add_job needs 'token'"):
            open_target("soft", TargetOptions(config=cfg)).deploy(cfg)
        monkeypatch.setenv(TOKEN_ENV, TOKEN)
        assert open_target("soft", TargetOptions(config=cfg)).deploy(cfg)


class Clock:
    """A clock the test moves on, so the rate limit is tested without waiting."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_wrong_keys_are_counted_and_an_address_past_the_limit_is_refused_unchecked(make_job, soft_switch):
    """Past the limit, changes to that job from that address wait unchecked; another job's (a group on the
    same host renewing its own) and add_job (whose credential is the token) do not."""
    cfg = make_job(2, k=64)
    other = make_job(2, k=64, job_id=2, slot_base=16)
    clock = Clock()
    server = ControlServer(("127.0.0.1", 0), soft_switch, guard=Guard(failures=3, window=10.0, clock=clock))
    try:
        control = Endpoint(*server.address)
        reset = {"op": "reset", "job": cfg.job_id, "key": cfg.key ^ 1}
        for _ in range(3):
            with pytest.raises(ConfigError, match="'key' is not job 1's key"):
                request(control, reset)
        generation = soft_switch.jobs()[cfg.job_id].generation
        for req in (reset, {**reset, "key": cfg.key}):
            with pytest.raises(ConfigError, match=r"3 wrong keys or tokens from 127.0.0.1 \(job 1\) within 10 s: "
                                                  r"changes from it are refused unchecked for 10.0 s more"):
                request(control, req)
        assert soft_switch.jobs()[cfg.job_id].generation == generation  # even the right key waits
        request(control, {"op": "reset", "job": other.job_id, "key": other.key})
        with pytest.raises(ConfigError, match="job 2 is already installed"):  # checked, not rate-limited
            request(control, {"op": "add_job", "config": other.to_toml()})
        counters = request(control, {"op": "status"})["control"]  # reads are not limited
        assert counters["auth_failures"] == 3 and counters["rate_limited"] == 2
        clock.now += 10.0
        assert request(control, {**reset, "key": cfg.key})["generation"] != generation
    finally:
        server.close()


def test_an_idle_connection_is_closed_with_a_word_and_counted(soft_switch):
    server = ControlServer(("127.0.0.1", 0), soft_switch, idle_timeout=0.2)
    try:
        with socket.create_connection(server.address, timeout=30) as conn:
            stream = conn.makefile("rb")
            assert "no request for 0.2 s: the connection is closed" in json.loads(stream.readline())["error"]
            assert stream.readline() == b""  # closed by the switch
        assert server.guard.counters()["idle_timeouts"] == 1
    finally:
        server.close()


class Broken:
    """A switch whose every read fails as no request's fault would."""

    address, backend, cores = ("127.0.0.1", 0), "test", 1

    def jobs(self):
        raise RuntimeError("the table is gone")


def test_a_fault_of_the_switch_is_an_error_reply_and_the_port_keeps_serving():
    server = ControlServer(("127.0.0.1", 0), Broken())
    try:
        with socket.create_connection(server.address, timeout=30) as conn:
            stream = conn.makefile("rwb")
            for _ in range(2):
                stream.write(b'{"op": "status"}\n')
                stream.flush()
                error = json.loads(stream.readline())["error"]
                assert error == "the switch failed to serve 'status' (RuntimeError: the table is gone); report it " \
                                "with the request"
        assert server.guard.counters() == {"requests": 2, "errors": 2, "auth_failures": 0, "rate_limited": 0,
                                           "idle_timeouts": 0}
    finally:
        server.close()


def test_a_reply_that_is_no_json_object_is_one_line_naming_the_port():
    """The client's side: whatever answers on the port, its reply is checked before use."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        endpoint = Endpoint(*listener.getsockname())

        def answer() -> None:
            conn, _ = listener.accept()
            with conn:
                conn.makefile("rb").readline()
                conn.sendall(b"SSH-2.0-OpenSSH\n")

        thread = threading.Thread(target=answer)
        thread.start()
        with pytest.raises(SwitchAggError, match=rf"the control port at {endpoint} answered b'SSH-2.0-OpenSSH\\n', "
                                                 "not a JSON object"):
            request(endpoint, {"op": "status"})
        thread.join()


def test_a_lease_lapses_at_its_deadline_and_a_renewal_moves_the_deadline_on():
    """The expiry rule alone, on a clock the test moves: nothing lapses a moment early, and a renewed
    lease lasts its whole length from the renewal."""
    lease = Lease.grant(10, now=100.0)
    assert (lease.deadline, lease.left(104.0)) == (110.0, 6.0)
    assert not lapsed(109.999, lease.deadline) and lapsed(110.0, lease.deadline)
    renewed = lease.renewed(108.0)
    assert renewed == Lease(10.0, 118.0) and renewed.left(200.0) == 0.0
    leases = {3: renewed, 1: lease, 2: Lease.grant(0.5, 109.0)}
    assert lapsed_jobs(leases, 109.4) == [] and lapsed_jobs(leases, 110.0) == [1, 2]
    assert Lease.grant(86400, 0.0).deadline == 86400.0
    for seconds in (0, -1, float("nan"), float("inf"), 86401, 1e10, "10", True, None):
        with pytest.raises(ConfigError, match="a lease is a number of seconds, more than 0"):
            Lease.grant(seconds, 0.0)


def test_a_leased_job_is_renewed_by_its_key_and_removed_with_its_slots_cleared_once_it_lapses():
    """Through the control port and the soft target, on the switch's clock moved by the test: status shows
    the lease and the deploying process, a wrong key's renewal is refused and counted, and the lapsed
    job goes as remove_job takes it (its slots at power-up), counted."""
    clock = Clock()
    (port,) = free_ports(1, socket.SOCK_STREAM)
    with SoftSwitch(("127.0.0.1", 0), control=("127.0.0.1", port), clock=clock) as sw:
        cfg = loopback_job(2, values_per_packet=64, slot_count=4, slot_base=8, switch_port=sw.address[1],
                           control_port=port)
        target = open_target("soft", TargetOptions(config=cfg))
        target.deploy(cfg, lease=5.0)
        job = request(control_of(sw), {"op": "status"})["jobs"][str(cfg.job_id)]
        assert job["lease"] == {"seconds": 5.0, "left": 5.0}
        assert job["owner"] == {"host": socket.gethostname(), "pid": os.getpid()}
        status = target.status(cfg.job_id)
        assert (status.lease, status.owner) == (5.0, f"{socket.gethostname()} pid {os.getpid()}")
        with pytest.raises(ConfigError, match="'key' is not job 1's key"):
            request(control_of(sw), {"op": "renew", "job": cfg.job_id, "key": cfg.key ^ 1})
        assert request(control_of(sw), {"op": "status"})["control"]["auth_failures"] == 1
        clock.now += 4.0
        assert sw.expire() == []
        target.renew(cfg.job_id)
        clock.now += 4.0
        assert sw.expire() == [] and sw.leases() == {cfg.job_id: (5.0, 1.0)}, "renewed at 4 s: 5 s more from then"
        contribution = make_header(PacketType.CONTRIB, job=cfg.job_id, worker=0, slot=1, chunk=1,
                                   generation=sw.jobs()[cfg.job_id].generation, key=cfg.key, count=64).pack()
        sw.model.process(contribution + bytes(4 * 64), cfg.workers[0].address.tuple)
        assert sw.model.registers(2 * (8 + 1)).count == 1
        clock.now += 1.0
        sw.expire()  # the timer thread may have been first: what counts is what is left
        assert sw.jobs() == {} and sw.leases() == {} and sw.owners() == {}
        assert [tuple(sw.model.registers(i)) for i in range(16, 24)] == [(0, 0, 0, 0, None)] * 8
        assert target.status(cfg.job_id).host_counters["leases_expired"] == 1
        assert target.status(cfg.job_id).host_counters["leases_renewed"] == 1


def test_a_job_without_a_lease_stays_and_p4_targets_refuse_a_lease_saying_what_to_do(make_job, soft_switch):
    cfg = make_job(2, k=64)
    with pytest.raises(ConfigError, match="job 1 holds no lease, so there is nothing to renew"):
        open_target("soft", TargetOptions(config=cfg)).renew(cfg.job_id)
    assert soft_switch.expire(float("inf")) == [] and cfg.job_id in soft_switch.jobs()
    assert request(control_of(soft_switch), {"op": "status"})["jobs"]["1"]["lease"] is None
    for name in ("bmv2", "tofino"):
        target = open_target(name, TargetOptions(config=cfg, address="127.0.0.1:1"))
        for call in (lambda t=target: t.deploy(cfg, lease=10.0), lambda t=target: t.renew(cfg.job_id)):
            with pytest.raises(UnsupportedOperation, match=f"the {name} target keeps no leases: .*no timer"):
                call()


@pytest.mark.parametrize("req, message", [
    ({"lease": 0}, "a lease is a number of seconds, more than 0"),
    ({"lease": "10"}, "a lease is a number of seconds"),
    ({"lease": 1e10}, "at most 86400 \\(a day"),  # the switch's timer cannot wait that long: it would end the switch
    ({"owner": "me"}, "'owner' is the deploying process"),
    ({"owner": {"host": "h", "pid": "1"}}, "'owner' is the deploying process"),
])
def test_add_job_refuses_a_lease_or_owner_it_cannot_read(soft_switch, req, message):
    cfg = loopback_job(2, values_per_packet=64, slot_count=16, switch_port=soft_switch.address[1])
    with pytest.raises(ConfigError, match=message):
        request(control_of(soft_switch), {"op": "add_job", "config": cfg.to_toml(), **req})
    assert soft_switch.jobs() == {}
