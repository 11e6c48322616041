"""BfRt, the Tofino SDE's control API, as the few calls the Tofino target makes.

The SDE ships its own gRPC client (``bfrt_grpc``, from open-p4studio's bf-drivers), matched to its
``bf_switchd``; switchagg does not vendor or reimplement it. :class:`BfrtSession` finds it (on the
path, or under ``$SDE_INSTALL``) and speaks to bf_switchd through it. Everything switchagg writes
is a table row: a name, a key and data fields (with an action for match tables), integers or lists
of integers, which :class:`TableSession` spells out so that a test can hold the same calls to the
``bfrt.json`` the compiler wrote.
"""

from __future__ import annotations

import glob
import ipaddress
import os
import sys
from typing import Any, NamedTuple, Protocol

from ..errors import SwitchAggError

P4_NAME = "switchagg"
Value = int | list[int] | list[bool]
Key = dict[str, int | tuple[int, int]]  # a field's value, or (value, mask) where the match is ternary


class Row(NamedTuple):
    """An entry as read back: its key, its action (None for tables without actions) and its data."""

    key: Key
    action: str | None
    data: dict[str, Any]


class TableSession(Protocol):
    """What the Tofino target does with a switch: write, read and delete rows, read counters."""

    def add(self, table: str, key: Key, data: dict[str, Value], action: str | None = None) -> None: ...

    def modify(self, table: str, key: Key, data: dict[str, Value], action: str | None = None) -> None: ...

    def delete(self, table: str, key: Key) -> None: ...

    def entries(self, table: str) -> list[Row]: ...

    def counter(self, table: str, index: int) -> int: ...


def sde_client() -> Any:
    """The SDE's ``bfrt_grpc.client`` module, or an error that says how to get it."""
    try:
        import bfrt_grpc.client as gc
    except ImportError:
        pass
    else:
        return gc
    sde = os.environ.get("SDE_INSTALL") or (os.environ.get("SDE") and os.path.join(os.environ["SDE"], "install"))
    looked = []
    if sde:
        for site in sorted(glob.glob(os.path.join(sde, "lib", "python3*", "site-packages"))):
            looked.append(site)
            sys.path[:0] = [os.path.join(site, "tofino"), site]
            try:
                import bfrt_grpc.client as gc
            except ImportError:
                sys.path[:2] = []
            else:
                return gc
    where = f" (looked in {', '.join(looked)})" if looked else " (SDE_INSTALL is not set)"
    raise SwitchAggError("the Tofino target needs the SDE's BfRt client, bfrt_grpc: build open-p4studio "
                         f"(the README's Tofino section) and set SDE_INSTALL to its install folder{where}")


def _number(value: Any) -> Any:
    """A value as read back, as the integer it was written as (the client shows MAC and IPv4 fields
    that carry the SDE's annotations as text)."""
    if isinstance(value, str):
        if ":" in value:
            return int(value.replace(":", ""), 16)
        return int(ipaddress.IPv4Address(value))
    return value


class BfrtSession:
    """One connection to bf_switchd's BfRt server, bound to the switchagg program, for one ``with`` block."""

    def __init__(self, address: str, device_id: int = 0) -> None:
        self.address, self.device_id = address, device_id

    def __enter__(self) -> BfrtSession:
        gc = self._gc = sde_client()
        try:
            self._interface = gc.ClientInterface(self.address, client_id=0, device_id=self.device_id, num_tries=1)
        except Exception as exc:  # grpc errors and the client's own RuntimeError
            raise SwitchAggError(f"cannot reach bf_switchd's BfRt server at {self.address} (device "
                                 f"{self.device_id}): {exc}; is bf_switchd running?") from None
        try:
            self._interface.bind_pipeline_config(P4_NAME)
            self._info = self._interface.bfrt_info_get(P4_NAME)
        except Exception as exc:
            self._interface.tear_down_stream()
            raise SwitchAggError(f"bf_switchd at {self.address} does not run the {P4_NAME} program ({exc}): start "
                                 "it with the configuration `switchagg build-p4 --target tofino` wrote") from None
        self._target = gc.Target(device_id=self.device_id, pipe_id=0xFFFF)
        return self

    def __exit__(self, *exc: object) -> None:
        self._interface.tear_down_stream()

    def _call(self, what: str, fn: Any, *args: Any, **kw: Any) -> Any:
        try:
            return fn(*args, **kw)
        except Exception as exc:  # BfruntimeRpcException and the client's KeyError/ValueError on names
            raise SwitchAggError(f"BfRt {what} failed: {exc}") from None

    def _table(self, name: str) -> Any:
        return self._call(f"looking up table {name}", self._info.table_get, name)

    def _key(self, table: Any, key: Key) -> Any:
        return table.make_key([self._gc.KeyTuple(name, *value) if isinstance(value, tuple)
                               else self._gc.KeyTuple(name, value) for name, value in key.items()])

    def _data(self, table: Any, data: dict[str, Value], action: str | None) -> Any:
        fields = []
        for name, value in data.items():
            if isinstance(value, list) and value and isinstance(value[0], bool):
                fields.append(self._gc.DataTuple(name, bool_arr_val=value))
            elif isinstance(value, list):
                fields.append(self._gc.DataTuple(name, int_arr_val=value))
            else:
                fields.append(self._gc.DataTuple(name, value))
        return table.make_data(fields, action)

    def add(self, table: str, key: Key, data: dict[str, Value], action: str | None = None) -> None:
        t = self._table(table)
        self._call(f"adding to {table}", t.entry_add, self._target, [self._key(t, key)], [self._data(t, data, action)])

    def modify(self, table: str, key: Key, data: dict[str, Value], action: str | None = None) -> None:
        t = self._table(table)
        self._call(f"modifying {table}", t.entry_mod, self._target, [self._key(t, key)], [self._data(t, data, action)])

    def delete(self, table: str, key: Key) -> None:
        t = self._table(table)
        self._call(f"deleting from {table}", t.entry_del, self._target, [self._key(t, key)])

    def entries(self, table: str) -> list[Row]:
        t = self._table(table)
        rows = []
        got = self._call(f"reading {table}", lambda: list(t.entry_get(self._target, None, {"from_hw": False})))
        for data, key in got:
            d = data.to_dict()
            action = d.pop("action_name", None)
            d.pop("is_default_entry", None)
            rows.append(Row({k: (_number(v["value"]), v["mask"]) if "mask" in v else _number(v["value"])
                             for k, v in key.to_dict().items()}, action,
                            {k: _number(v) for k, v in d.items()}))
        return rows

    def counter(self, table: str, index: int) -> int:
        t = self._table(table)
        key = [self._key(t, {"$COUNTER_INDEX": index})]
        got = self._call(f"reading {table}[{index}]", lambda: list(t.entry_get(self._target, key, {"from_hw": True})))
        return sum(int(data.to_dict()["$COUNTER_SPEC_PKTS"]) for data, _ in got)
