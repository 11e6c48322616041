"""A BMv2 test bed: one namespace per host, a veth from each to a BMv2 port, the switchagg pipeline.

Hosts are ``<prefix>h<i>`` with interface ``eth0`` (MAC 02:5a:00:00:<b>:<i+1>), on 10.77.<b>.0/24;
the switch answers at 10.77.<b>.254 (its MAC is static in every host's neighbour table, since the
P4 program answers no ARP). BMv2 runs here in the root namespace, gRPC on 127.0.0.1 only, its output
(stdout and stderr) in a file under RUN_DIR. :class:`TreeBed` joins several into two levels of a tree
(docs/protocol.md section 10): leaf switches with their hosts, and a spine whose ports are the
leaves' uplinks.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from switchagg import netns
from switchagg.config import Endpoint, JobConfig, WorkerSpec
from switchagg.loopback import free_ports
from switchagg.targets.p4c import Pipeline, build, find_tool

RUN_DIR = Path("/run/switchagg-bmv2")  # the beds' state and BMv2's output, by prefix


def missing_prerequisites() -> str | None:
    """What keeps a test bed from being built here, in words; None when nothing does."""
    problems = []
    if os.geteuid() != 0:
        problems.append("root (for namespaces and veths)")
    for tool in ("ip", "ethtool"):
        if shutil.which(tool) is None:
            problems.append(f"`{tool}`")
    for tool in ("p4c-bm2-ss", "simple_switch_grpc"):
        if find_tool(tool) is None:
            problems.append(f"`{tool}` (see the README: install p4c and BMv2)")
    try:
        import p4runtime_sh  # noqa: F401
    except ImportError:
        problems.append("p4runtime-shell (pip install 'switchagg[p4]')")
    return ("needs " + ", ".join(problems)) if problems else None


def free_tcp_port() -> int:
    (port,) = free_ports(1, socket.SOCK_STREAM)
    return port


@dataclass
class TestBed:
    """``n_hosts`` hosts around one BMv2; ``with TestBed(...) as bed:`` builds and removes it."""

    __test__ = False  # not a pytest test class, whatever its name

    n_hosts: int
    prefix: str = "sa"
    subnet: int = 77
    host_ips: bool = True  # False: bare links, for injecting raw frames (nothing in a host answers)
    log: Path | None = None  # BMv2's packet log (--log-file), if any
    # BMv2's stdout and stderr (default RUN_DIR/<prefix>.simple_switch.log): a file, never a pipe, since
    # a bed left running by `python -m bmv2_env up` outlives whoever would read the pipe, and BMv2's next
    # write to it would kill BMv2 with SIGPIPE.
    output: Path | None = None
    pipeline: Pipeline | None = None
    switch_binary: str | None = None  # another simple_switch_grpc build (default: the one on PATH)
    grpc_port: int = field(default_factory=free_tcp_port)
    thrift_port: int = field(default_factory=free_tcp_port)
    links: dict[int, str] = field(default_factory=dict)  # switch ports past the hosts': port -> device, made by others
    # a bridge here (made by others) that each host joins too, as ``mgmt0`` at mgmt_ip(i): a management network,
    # for what must cross between the hosts of different switches (torch's store and gloo in a tree)
    mgmt: str | None = None
    _proc: subprocess.Popen | None = None

    @property
    def grpc_addr(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def switch_ip(self) -> str:
        return f"10.{self.subnet}.0.254"

    @property
    def switch_mac(self) -> str:
        return f"02:5a:00:00:{self.subnet:02x}:fe"

    def host(self, i: int) -> str:
        return f"{self.prefix}h{i}"

    def host_ip(self, i: int) -> str:
        return f"10.{self.subnet}.0.{i + 1}"

    def host_mac(self, i: int) -> str:
        return f"02:5a:00:00:{self.subnet:02x}:{i + 1:02x}"

    def mgmt_ip(self, i: int) -> str:
        return f"10.99.{self.subnet}.{i + 1}"

    def port_dev(self, i: int) -> str:
        return f"{self.prefix}p{i}"

    # ---- lifecycle -------------------------------------------------------------------------------

    def up(self) -> TestBed:
        problem = missing_prerequisites()
        if problem:
            raise RuntimeError(f"cannot build the BMv2 test bed: it {problem}")
        self.down()  # leftovers of an earlier run with the same prefix
        self.pipeline = self.pipeline or build()
        try:
            for i in range(self.n_hosts):
                ns = self.host(i)
                netns.add_namespace(ns)
                netns.veth_into(self.port_dev(i), "eth0", ns, self.host_mac(i))
                if self.host_ips:
                    netns.sh("ip", "addr", "add", f"{self.host_ip(i)}/24", "dev", "eth0", ns=ns)
                    netns.sh("ip", "neigh", "replace", self.switch_ip, "lladdr", self.switch_mac, "dev", "eth0",
                             "nud", "permanent", ns=ns)
                if self.mgmt:
                    dev = f"{self.prefix}m{i}"
                    netns.veth_into(dev, "mgmt0", ns, f"02:5b:00:00:{self.subnet:02x}:{i + 1:02x}")
                    netns.sh("ip", "link", "set", dev, "master", self.mgmt)
                    netns.sh("ip", "addr", "add", f"{self.mgmt_ip(i)}/16", "dev", "mgmt0", ns=ns)
            self._start_switch()
        except BaseException:
            self.down()
            raise
        return self

    def _start_switch(self) -> None:
        binary = self.switch_binary or find_tool("simple_switch_grpc")
        argv = [binary, "--no-p4", "--thrift-port", str(self.thrift_port)]
        for i in range(self.n_hosts):
            argv += ["-i", f"{i}@{self.port_dev(i)}"]
        for port, dev in self.links.items():
            argv += ["-i", f"{port}@{dev}"]
        if self.log:
            argv += ["--log-file", str(self.log), "--log-flush"]
        argv += ["--", "--grpc-server-addr", self.grpc_addr]
        self.output = self.output or RUN_DIR / f"{self.prefix}.simple_switch.log"
        self.output.parent.mkdir(parents=True, exist_ok=True)
        with self.output.open("wb") as out:
            self._proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                          start_new_session=True)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                tail = self.output.read_bytes()[-2000:].decode(errors="replace")
                raise RuntimeError(f"simple_switch_grpc exited (its output is in {self.output}):\n{tail}")
            try:
                with socket.create_connection(("127.0.0.1", self.grpc_port), timeout=0.2):
                    break
            except OSError:
                time.sleep(0.1)
        else:
            raise RuntimeError("simple_switch_grpc did not open its gRPC port within 20 s")
        from switchagg.targets.bmv2 import P4RuntimeSession

        with P4RuntimeSession(self.grpc_addr, 0, self.pipeline):
            pass  # pushes the pipeline

    def down(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None
        for ns in netns.namespaces(f"{self.prefix}h"):
            netns.delete_namespace(ns)
        for i in range(self.n_hosts):
            netns.sh("ip", "link", "delete", self.port_dev(i), check=False)
            if self.mgmt:
                netns.sh("ip", "link", "delete", f"{self.prefix}m{i}", check=False)

    def __enter__(self) -> TestBed:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()

    # ---- jobs ------------------------------------------------------------------------------------

    def job(self, hosts: list[int], *, job_id: int = 1, slot_base: int = 0, slot_count: int = 16,
            key: int = 0x5EED, port_base: int = 40000, control: Endpoint | None = None) -> JobConfig:
        """A job whose rank r runs on host ``hosts[r]``, UDP port ``port_base + job_id``."""
        return JobConfig(
            switch=Endpoint(self.switch_ip, 16711), control=control, job_id=job_id, key=key,
            slot_base=slot_base, slot_count=slot_count, values_per_packet=64,
            workers=tuple(WorkerSpec(Endpoint(self.host_ip(h), port_base + job_id), mac=self.host_mac(h),
                                     switch_port=h) for h in hosts))

    def exec(self, i: int, argv: list[str], **kw) -> subprocess.Popen:
        """Start a command in host ``i``."""
        return subprocess.Popen(["ip", "netns", "exec", self.host(i), *argv], **kw)


@dataclass
class TreeBed:
    """``leaves`` leaf BMv2 switches of ``per_leaf`` hosts each (``leaf[i]``, subnet ``subnet + 1 + i``) and a
    spine BMv2 (subnet ``subnet``, no hosts): leaf i's port ``per_leaf`` is linked to the spine's port i by a veth
    pair here in the root namespace. ``with TreeBed(...) as tree:`` builds and removes all of it."""

    __test__ = False

    leaves: int
    per_leaf: int
    prefix: str = "sat"
    subnet: int = 80
    mgmt: bool = False  # a management network between every host (TestBed.mgmt), for torch's store and gloo
    leaf: list[TestBed] = field(default_factory=list)
    spine: TestBed | None = None

    def uplink_dev(self, i: int, end: str) -> str:
        """Leaf i's uplink: its end at the leaf ("l") or at the spine ("s")."""
        return f"{self.prefix}u{i}{end}"

    def up(self) -> TreeBed:
        self.down()
        pipeline = build()
        try:
            if self.mgmt:
                netns.sh("ip", "link", "add", self.mgmt_bridge, "type", "bridge")
                netns.quiet_link(self.mgmt_bridge)
            for i in range(self.leaves):
                netns.sh("ip", "link", "add", self.uplink_dev(i, "l"), "type", "veth", "peer", "name",
                         self.uplink_dev(i, "s"))
                for end in "ls":
                    netns.quiet_link(self.uplink_dev(i, end))
            self.spine = TestBed(0, prefix=f"{self.prefix}s", subnet=self.subnet, pipeline=pipeline,
                                 links={i: self.uplink_dev(i, "s") for i in range(self.leaves)}).up()
            self.leaf = []
            for i in range(self.leaves):
                self.leaf.append(TestBed(self.per_leaf, prefix=f"{self.prefix}{i}", subnet=self.subnet + 1 + i,
                                         pipeline=pipeline, links={self.per_leaf: self.uplink_dev(i, "l")},
                                         mgmt=self.mgmt_bridge if self.mgmt else None).up())
        except BaseException:
            self.down()
            raise
        return self

    def tree_file(self, *, job_id: int = 1, key: int = 0x7EE, slot_count: int = 16) -> str:
        """The tree file (switchagg.tree) of this bed: every level's P4Runtime address as its control, the
        switches' Ethernet addresses and the ports of every link, as `switchagg deploy --target bmv2` takes it."""
        spine = self.spine
        text = (f"[job]\nid = {job_id}\nkey = {key:#x}\nslot_count = {slot_count}\n\n"
                f'[spine]\naddress = "{spine.switch_ip}:16711"\ncontrol = "{spine.grpc_addr}"\n'
                f'mac = "{spine.switch_mac}"\n')
        for i, leaf in enumerate(self.leaf):
            workers = ",\n".join(f'  {{ address = "{w.address}", mac = "{w.mac}", switch_port = {w.switch_port} }}'
                                 for w in leaf.job(list(range(self.per_leaf)), job_id=job_id).workers)
            text += (f'\n[[leaves]]\naddress = "{leaf.switch_ip}:16711"\ncontrol = "{leaf.grpc_addr}"\n'
                     f'mac = "{leaf.switch_mac}"\nuplink_port = {self.per_leaf}\nspine_port = {i}\n'
                     f"workers = [\n{workers},\n]\n")
        return text

    def down(self) -> None:
        for bed in [*self.leaf, *([self.spine] if self.spine else [])]:
            bed.down()
        self.leaf, self.spine = [], None
        for i in range(self.leaves):
            netns.sh("ip", "link", "delete", self.uplink_dev(i, "l"), check=False)
        netns.sh("ip", "link", "delete", self.mgmt_bridge, check=False)

    @property
    def mgmt_bridge(self) -> str:
        return f"{self.prefix}mg"

    def __enter__(self) -> TreeBed:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()
