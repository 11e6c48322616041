"""torch's own distributed test suite, run against the ``switchagg`` backend (``tests/test_torch_suite.py`` drives it).

torch ships the suite that its own backends pass: ``DistributedTest._DistTestBase`` in
``torch.testing._internal.distributed.distributed_test``, parameterized by the variables
``BACKEND``, ``WORLD_SIZE`` and ``TEMP_DIR``, which it reads when it is imported (its skip
decorators are decided then). This module is its driver for the ``switchagg`` backend, as
upstream's ``test/distributed/test_distributed_spawn.py`` is for gloo and NCCL; the test beside it
runs this module in a pytest of its own per world size and pass, with an embedded switch in the
``SWITCHAGG_SWITCH``/``SWITCHAGG_CONTROL`` variables.

**The feature sets.** The suite keeps, in ``common_distributed.DistTestCases``, which backend can
do what. ``switchagg`` joins ``ddp`` (DDP over the group), ``subgroup`` (``new_group`` and
``new_subgroups``) and ``plugin`` (a backend registered from Python counts as available): what a
CPU group does. Not ``gpu`` or ``cuda``: those tests need a GPU per rank.

**Two passes.** ``SWITCHAGG_TORCH_SUITE_AS=switchagg`` (the default) imports the suite with
``BACKEND=switchagg``: every test it runs for that name. Some tests skip, or take another branch
inside, for any backend not named "gloo" (the timeouts of ``barrier``, ``monitored_barrier``,
batched send/recv on CPU, sparse all-reduce, several DDP tests), although switchagg hands those
calls to the gloo backend registered on its group. ``SWITCHAGG_TORCH_SUITE_AS=gloo`` is the shim
for them: the suite is imported with ``BACKEND=gloo``, so it decides its skips and branches as for
gloo, and the ``torch.distributed`` it calls is :class:`_AsGloo`, which makes every group it asks
for with the name gloo a switchagg group (``get_backend`` still says switchagg: told gloo, the
suite would look for gloo's profiler events, which a call through the switch does not make). That pass
runs only :data:`NAME_GATED`: the tests that the name alone skips (found by importing the suite a
second time under the name switchagg); run it with ``-p tests.torch_suite``, which lets this
module's hook deselect the others.

**Processes.** Each test forks its ranks from this process (upstream spawns, which imports the
suite again in every rank, about 5 s each on the CI's cores); nothing here has started a thread
before the fork. A forked rank ends without running atexit, so :meth:`TestSwitchAggBackend._run`
destroys what groups a skipped or failed test left.
"""

from __future__ import annotations

import importlib.util
import os
import types
from typing import Any

import pytest
import torch.distributed as dist
import torch.multiprocessing

import switchagg.distributed  # noqa: F401 - registers the backend, in this process and so in its forks

_OURS = "switchagg"
AS = os.environ.get("SWITCHAGG_TORCH_SUITE_AS", _OURS)
if AS not in (_OURS, "gloo"):
    raise ValueError(f"SWITCHAGG_TORCH_SUITE_AS = {AS!r}: use switchagg or gloo")
os.environ["BACKEND"] = AS

from torch.testing._internal import common_distributed  # noqa: E402 - after BACKEND, before the suite

for _feature in ("ddp", "subgroup", "plugin"):
    common_distributed.DistTestCases.backend_feature[_feature].add(_OURS)

from torch.testing._internal.distributed import distributed_test  # noqa: E402 - reads BACKEND when imported


class _AsGloo(types.ModuleType):
    """``torch.distributed`` as the shim pass's suite sees it: groups asked for as gloo are switchagg's."""

    _MAKERS = ("init_process_group", "new_group", "new_subgroups", "new_subgroups_by_enumeration")

    def __init__(self) -> None:
        super().__init__(dist.__name__)

    def __getattr__(self, name: str) -> Any:
        real = getattr(dist, name)
        if name in self._MAKERS:
            def make(*args: Any, **kwargs: Any) -> Any:
                if str(kwargs.get("backend", "")).lower() == "gloo":
                    kwargs["backend"] = _OURS
                return real(*args, **kwargs)
            return make
        return real


def _skips(backend: str) -> set[str]:
    """The tests of a copy of the suite imported under ``backend`` that skip for that name."""
    spec = importlib.util.find_spec(distributed_test.__name__)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    os.environ["BACKEND"] = backend
    try:
        spec.loader.exec_module(module)  # type: ignore[union-attr]
    finally:
        os.environ["BACKEND"] = AS
    suite = module.DistributedTest._DistTestBase
    return {name for name, fn in vars(suite).items()
            if name.startswith("test_") and getattr(fn, "__unittest_skip__", False)}


class TestSwitchAggBackend(distributed_test.TestDistBackend, distributed_test.DistributedTest._DistTestBase):
    """torch's suite on switchagg process groups, their ranks forked (see the module's docstring)."""

    def setUp(self) -> None:
        super().setUp()
        self._start_processes(torch.multiprocessing.get_context("fork").Process)

    @classmethod
    def _run(cls, rank: int, test_name: str, file_name: str, pipe: Any, **kwargs: Any) -> None:
        """A rank's test; then the groups it left destroyed, as the program's end would."""
        try:
            super()._run(rank, test_name, file_name, pipe, **kwargs)
        finally:  # a forked process ends without atexit: a test that skips or fails midway leaves its groups
            if dist.is_initialized():
                dist.destroy_process_group()


NAME_GATED: list[str] = []
if AS == "gloo":
    distributed_test.dist = _AsGloo()
    _suite = distributed_test.DistributedTest._DistTestBase
    NAME_GATED = sorted(name for name in _skips(_OURS)
                        if not getattr(getattr(_suite, name), "__unittest_skip__", False))


# Tests that fail for a reason outside this driver's reach, each with its reason and whether it
# always fails (strict: the day it passes, the run says so and its entry goes).
_MONITORED = ("torch's dist.monitored_barrier refuses any group whose backend is not named gloo (\"monitored_barrier "
              "is only implemented for GLOO backend\"): the README says what to use instead")
KNOWN = {"test_monitored_barrier_gloo": (_MONITORED, True), "test_monitored_barrier_gloo_subgroup": (_MONITORED, True)}


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    """The shim pass runs only :data:`NAME_GATED`; :data:`KNOWN` are expected to fail (pytest loads
    this module as a plugin too, ``-p tests.torch_suite``, for this hook)."""
    if AS == "gloo":
        config.hook.pytest_deselected(items=[item for item in items if item.name not in NAME_GATED])
        items[:] = [item for item in items if item.name in NAME_GATED]
    for item in items:
        if item.name in KNOWN:
            reason, strict = KNOWN[item.name]
            item.add_marker(pytest.mark.xfail(reason=reason, strict=strict))
