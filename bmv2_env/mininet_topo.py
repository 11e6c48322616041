#!/usr/bin/python3
"""A mininet topology around BMv2 running switchagg: N hosts on one switch.

    sudo /usr/bin/python3 bmv2_env/mininet_topo.py --workers 4 [--run]

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
        self.cmd(" ".join(argv) + " > /tmp/switchagg-mininet-bmv2.log 2>&1 &")
        deadline = time.time() + 20
        while time.time() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.grpc_port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError("simple_switch_grpc did not start: see /tmp/switchagg-mininet-bmv2.log")

    def stop(self, deleteIntfs=True):
        self.cmd(f"pkill -f 'grpc-server-addr 127.0.0.1:{self.grpc_port}'")
        Switch.stop(self, deleteIntfs)


class StarTopo(Topo):
    def build(self, n):
        s = self.addSwitch("s1", cls=Bmv2Switch)
        for i in range(n):
            h = self.addHost(f"h{i}", ip=f"10.77.0.{i + 1}/24", mac=f"02:5a:00:00:4d:{i + 1:02x}")
            self.addLink(h, s, port2=i + 1)


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
    parser.add_argument("--venv", default=os.path.join(ROOT, ".venv"), help="the venv with switchagg installed")
    parser.add_argument("--run", action="store_true", help="run a checking worker on every host, then stop")
    args = parser.parse_args()
    switchagg = os.path.join(args.venv, "bin", "switchagg")
    net = Mininet(topo=StarTopo(args.workers), controller=None, autoSetMacs=False)
    net.start()
    try:
        with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
            f.write(job_toml(args.workers))
        for i in range(args.workers):
            h = net.get(f"h{i}")
            h.cmd(f"ethtool -K h{i}-eth0 tx off rx off")
            h.cmd(f"ip neigh replace {SWITCH_IP} lladdr {SWITCH_MAC} dev h{i}-eth0 nud permanent")
        subprocess.run([switchagg, "deploy", "--target", "bmv2", "--config", f.name, "--pipeline",
                        os.path.join(ROOT, "build", "bmv2")], check=True, cwd=ROOT)
        if not args.run:
            CLI(net)
            return 0
        procs = [net.get(f"h{i}").popen([switchagg, "worker", "--config", f.name, "--rank", str(i), "--size",
                                         "20000"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for i in range(args.workers)]
        failed = 0
        for i, p in enumerate(procs):
            out, _ = p.communicate(timeout=300)
            print(f"h{i}: " + out.strip().replace("\n", f"\nh{i}: "))
            failed += p.returncode != 0
        return 1 if failed else 0
    finally:
        net.stop()


if __name__ == "__main__":
    sys.exit(main())
