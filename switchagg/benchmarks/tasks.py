"""Worker processes that live for a whole bench, each in its namespace, fed tasks one JSON line at a time.

The link bench and the tree bench both keep one process per rank across their runs (a process group,
a socket, torch's import cost once), hand each a task on stdin and read its answer from stdout. This
is both ends of that: :func:`serve` is a worker's loop, :class:`TaskWorkers` the bench's side.
"""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

from ..errors import SwitchAggError

RESULT = "RESULT "  # a worker's answer to a task, on a line of its stdout (anything else it prints is not one)


def serve(answer: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
    """A worker's loop: every task on stdin answered on stdout; an exception is the answer's ``error``, which the
    bench reports, so that one failed task does not end the worker."""
    for line in sys.stdin:
        try:
            reply = answer(json.loads(line))
        except Exception:  # noqa: BLE001 - the bench reports it
            reply = {"error": traceback.format_exc()}
        print(RESULT + json.dumps(reply), flush=True)


class TaskWorkers:
    """One process per rank, started from ``argvs`` with ``envs``, stderr to ``logs``; ``name`` says whose
    workers they are in errors ("link bench")."""

    def __init__(self, argvs: Sequence[Sequence[str]], envs: Sequence[dict[str, str]], logs: Sequence[Path],
                 name: str) -> None:
        self.n, self.logs, self.name = len(argvs), list(logs), name
        self.procs: list[subprocess.Popen] = []
        self.answers: queue.Queue[tuple[int, str | None]] = queue.Queue()
        try:
            for rank, (argv, env) in enumerate(zip(argvs, envs, strict=True)):
                with self.logs[rank].open("w") as log:
                    proc = subprocess.Popen(list(argv), env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                            stderr=log, text=True)
                self.procs.append(proc)
                threading.Thread(target=self._read, args=(rank, proc.stdout), daemon=True).start()
        except BaseException:
            self.kill()
            raise

    def _read(self, rank: int, out: IO[str]) -> None:
        for line in out:
            if line.startswith(RESULT):
                self.answers.put((rank, line[len(RESULT):]))
        self.answers.put((rank, None))

    def run(self, tasks: Sequence[dict[str, Any]], timeout: float) -> list[dict[str, Any]]:
        """Every rank's answer to its task (each task's ``tag`` names it in errors); raises if one failed, died
        or did not answer within ``timeout`` seconds."""
        tag = tasks[0]["tag"]
        for rank, (proc, task) in enumerate(zip(self.procs, tasks, strict=True)):
            try:
                proc.stdin.write(json.dumps(task) + "\n")  # type: ignore[union-attr]
                proc.stdin.flush()  # type: ignore[union-attr]
            except BrokenPipeError:
                raise SwitchAggError(f"{self.name} worker {rank} exited before {tag}: {self._log(rank)}") from None
        got: dict[int, dict[str, Any]] = {}
        deadline = time.monotonic() + timeout
        while len(got) < self.n:
            try:
                rank, text = self.answers.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise SwitchAggError(f"the {self.name}'s workers did not finish {tag} within {timeout:.0f} s "
                                     f"(ranks {sorted(set(range(self.n)) - set(got))} did not answer)") from None
            if text is None:
                raise SwitchAggError(f"{self.name} worker {rank} exited during {tag}: {self._log(rank)}")
            got[rank] = json.loads(text)
            if "error" in got[rank]:
                raise SwitchAggError(f"{self.name} worker {rank} failed in {tag}: {got[rank]['error'][-2000:]}")
        return [got[r] for r in range(self.n)]

    def _log(self, rank: int) -> str:
        return self.logs[rank].read_text()[-2000:]

    def close(self) -> None:
        """Let every worker finish (stdin closed), killing any that does not within 10 s."""
        for proc in self.procs:
            proc.stdin.close()  # type: ignore[union-attr]
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def kill(self) -> None:
        """Stop every worker now (after an error: a rank may wait in a call for the others)."""
        for proc in self.procs:
            proc.kill()
            proc.wait()
