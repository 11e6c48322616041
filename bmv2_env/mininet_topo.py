#!/usr/bin/python3
"""A mininet topology around BMv2 running switchagg: N hosts on one switch, or a tree of them.

    sudo /usr/bin/python3 bmv2_env/mininet_topo.py --workers 4 [--run]
    sudo /usr/bin/python3 bmv2_env/mininet_topo.py --tree 2x4 [--run]

``--tree LEAVESxWORKERS`` builds a spine BMv2 over LEAVES leaf BMv2s of WORKERS hosts each (docs/protocol.md
section 10) and deploys one tree file on all three levels (``switchagg deploy --target bmv2`` with the
tree file: each level's P4Runtime address, the switches' MACs and the ports of every link).

Debian's mininet imports only from Debian's own python3, so this file imports nothing of
switchagg: it drives the project's command line in ``--venv`` to compile and push the program and
to deploy a job for all hosts. ``--run`` starts ``switchagg worker`` on every host and prints what
each reports; without it you get the mininet CLI (``h0 ping h1`` works: the P4 program forwards
ordinary traffic).
"""

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

from mininet.cli import CLI
from mininet.net import Mininet
from mininet.node import Switch
from mininet.topo import Topo

SWITCH_IP, SWITCH_MAC = "10.77.0.254", "02:5a:00:00:4d:fe"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Bmv2Switch(Switch):
    """simple_switch_grpc with the mininet links as its ports (port number = mininet port)."""

    def __init__(self, name, grpc_port=9559, thrift_port=9090, **kw):
        kw["inNamespace"] = False
        Switch.__init__(self, name, **kw)
        self.grpc_port, self.thrift_port = grpc_port, thrift_port

    def start(self, controllers):
        binary = shutil.which("simple_switch_grpc") or "/opt/p4/bin/simple_switch_grpc"
        argv = [binary, "--no-p4", "--thrift-port", str(self.thrift_port)]
        for port, intf in sorted(self.intfs.items()):
            if intf.name != "lo":
                self.cmd(f"ethtool -K {intf.name} tx off rx off tso off gso off gro off")  # see netns.quiet_link
                argv += ["-i", f"{port}@{intf.name}"]
        argv += ["--", "--grpc-server-addr", f"127.0.0.1:{self.grpc_port}"]
        self.cmd(" ".join(argv) + f" > /tmp/switchagg-mininet-{self.name}.log 2>&1 &")
        deadline = time.time() + 20
        while time.time() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.grpc_port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError(f"simple_switch_grpc did not start: see /tmp/switchagg-mininet-{self.name}.log")

    def stop(self, deleteIntfs=True):
        self.cmd(f"pkill -f 'grpc-server-addr 127.0.0.1:{self.grpc_port}'")
        Switch.stop(self, deleteIntfs)


class StarTopo(Topo):
    def build(self, n):
        s = self.addSwitch("s1", cls=Bmv2Switch)
        for i in range(n):
            h = self.addHost(f"h{i}", ip=f"10.77.0.{i + 1}/24", mac=f"02:5a:00:00:4d:{i + 1:02x}")
            self.addLink(h, s, port2=i + 1)


def switch_ip(level):
    """The spine's address (level 0) and each leaf's (level 1 + its index), each on its own subnet."""
    return f"10.{77 + level}.0.254" if level else SWITCH_IP


def switch_mac(level):
    return f"02:5a:00:00:{77 + level:02x}:fe"


def host_ip(leaf, i):
    return f"10.{78 + leaf}.0.{i + 1}"


def host_mac(leaf, i):
    return f"02:5a:00:00:{78 + leaf:02x}:{i + 1:02x}"


class TreeTopo(Topo):
    """Spine s0 (P4Runtime 9559) over leaves s1.. (9560..), each with ``per_leaf`` hosts on its ports 1..,
    its port ``per_leaf + 1`` linked to the spine's port ``leaf + 1``; host ``h<leaf>x<i>``."""

    def build(self, leaves, per_leaf):
        spine = self.addSwitch("s0", cls=Bmv2Switch, grpc_port=9559, thrift_port=9090)
        for leaf in range(leaves):
            s = self.addSwitch(f"s{leaf + 1}", cls=Bmv2Switch, grpc_port=9560 + leaf, thrift_port=9091 + leaf)
            for i in range(per_leaf):
                h = self.addHost(f"h{leaf}x{i}", ip=f"{host_ip(leaf, i)}/24", mac=host_mac(leaf, i))
                self.addLink(h, s, port2=i + 1)
            self.addLink(s, spine, port1=per_leaf + 1, port2=leaf + 1)


def tree_toml(leaves, per_leaf):
    """The tree file of TreeTopo: every level's P4Runtime address, the switches' MACs, the links' ports."""
    lines = ["[job]", "id = 1", "key = 0x5eed", "slot_count = 32", "values_per_packet = 64", "",
             "[spine]", f'address = "{switch_ip(0)}:16711"', 'control = "127.0.0.1:9559"', f'mac = "{switch_mac(0)}"']
    for leaf in range(leaves):
        workers = ", ".join(f'{{ address = "{host_ip(leaf, i)}:40001", mac = "{host_mac(leaf, i)}", '
                            f"switch_port = {i + 1} }}" for i in range(per_leaf))
        lines += ["", "[[leaves]]", f'address = "{switch_ip(leaf + 1)}:16711"',
                  f'control = "127.0.0.1:{9560 + leaf}"', f'mac = "{switch_mac(leaf + 1)}"',
                  f"uplink_port = {per_leaf + 1}", f"spine_port = {leaf + 1}", f"workers = [{workers}]"]
    return "\n".join(lines) + "\n"


def job_toml(n):
    lines = ["[switch]", f'address = "{SWITCH_IP}:16711"', "", "[job]", "id = 1", "key = 0x5eed",
             "slot_base = 0", "slot_count = 32", "values_per_packet = 64"]
    for i in range(n):
        lines += ["", "[[workers]]", f'address = "10.77.0.{i + 1}:40001"', f'mac = "02:5a:00:00:4d:{i + 1:02x}"',
                  f"switch_port = {i + 1}"]
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--tree", metavar="LEAVESxWORKERS", help="instead: a spine over LEAVES leaves of WORKERS "
                                                                 "hosts each")
    parser.add_argument("--venv", default=os.path.join(ROOT, ".venv"), help="the venv with switchagg installed")
    parser.add_argument("--run", action="store_true", help="run a checking worker on every host, then stop")
    args = parser.parse_args()
    switchagg = os.path.join(args.venv, "bin", "switchagg")
    if args.tree:
        leaves, per_leaf = (int(n) for n in args.tree.lower().split("x"))
        topo, text = TreeTopo(leaves, per_leaf), tree_toml(leaves, per_leaf)
        hosts = [(f"h{leaf}x{i}", switch_ip(leaf + 1), switch_mac(leaf + 1)) for leaf in range(leaves)
                 for i in range(per_leaf)]
    else:
        topo, text = StarTopo(args.workers), job_toml(args.workers)
        hosts = [(f"h{i}", SWITCH_IP, SWITCH_MAC) for i in range(args.workers)]
    net = Mininet(topo=topo, controller=None, autoSetMacs=False)
    net.start()
    try:
        with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
            f.write(text)
        for name, ip, mac in hosts:
            h = net.get(name)
            h.cmd(f"ethtool -K {name}-eth0 tx off rx off")
            h.cmd(f"ip neigh replace {ip} lladdr {mac} dev {name}-eth0 nud permanent")
        subprocess.run([switchagg, "deploy", "--target", "bmv2", "--config", f.name, "--pipeline",
                        os.path.join(ROOT, "build", "bmv2")], check=True, cwd=ROOT)
        if not args.run:
            CLI(net)
            return 0
        procs = [net.get(name).popen([switchagg, "worker", "--config", f.name, "--rank", str(rank), "--size",
                                      "20000"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for rank, (name, _, _) in enumerate(hosts)]
        failed = 0
        for (name, _, _), p in zip(hosts, procs, strict=True):
            out, _ = p.communicate(timeout=300)
            print(f"{name}: " + out.strip().replace("\n", f"\n{name}: "))
            failed += p.returncode != 0
        return 1 if failed else 0
    finally:
        net.stop()


if __name__ == "__main__":
    sys.exit(main())
