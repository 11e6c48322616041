"""A switch's tables as the compiled program's ``bfrt.json`` declares them, for the Tofino control plane.

:class:`SchemaSession` takes the calls the Tofino target makes over BfRt and refuses, as bf_switchd
would, any table, key field, action, parameter or data field that ``bfrt.json`` lacks, any field
left out, and any value wider than its field; what it accepts it keeps as rows, which it reads
back. The packet replication engine's ``$pre`` tables are the SDE's fixed ones, not the program's:
their fields are those of the SDE's BfRt ``$pre`` schema, written out below.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from switchagg.targets.bfrt import Row

# The SDE's fixed multicast tables (bf-drivers' PRE schema): field -> width in bits (0: a list).
PRE: dict[str, tuple[dict[str, int], dict[str, int]]] = {
    "$pre.node": ({"$MULTICAST_NODE_ID": 32}, {"$MULTICAST_RID": 16, "$MULTICAST_LAG_ID": 0, "$DEV_PORT": 0}),
    "$pre.mgid": ({"$MGID": 16}, {"$MULTICAST_NODE_ID": 0, "$MULTICAST_NODE_L1_XID_VALID": 0,
                                  "$MULTICAST_NODE_L1_XID": 0}),
}


_WIDTHS = {"uint8": 8, "uint16": 16, "uint32": 32, "uint64": 64}


def _width(field: dict[str, Any]) -> int:
    """A field's width in bits (0: no bound to check, e.g. a list or a bool)."""
    kind = field.get("type", {})
    return kind.get("width", _WIDTHS.get(kind.get("type"), 0))


class Table:
    """One table of bfrt.json: its size, its key fields (width, match type) and, per action (None: the
    table's own data), its fields' widths."""

    def __init__(self, name: str, size: int | None, keys: dict[str, tuple[int, str]],
                 actions: dict[str | None, dict[str, int]]) -> None:
        self.name, self.size, self.keys, self.actions = name, size, keys, actions

    @classmethod
    def of(cls, spec: dict[str, Any]) -> Table:
        keys = {k["name"]: (_width(k), k["match_type"]) for k in spec.get("key", [])}
        actions: dict[str | None, dict[str, int]] = {a["name"]: {d["name"]: _width(d) for d in a.get("data", [])}
                                                     for a in spec.get("action_specs", [])}
        actions[None] = {(d.get("singleton", d))["name"]: _width(d.get("singleton", d)) for d in spec.get("data", [])}
        return cls(spec["name"], spec.get("size"), keys, actions)


def load(bfrt_json: Path) -> dict[str, Table]:
    """The tables of a compiled program, by the name BfRt knows them by, and the SDE's ``$pre`` tables."""
    tables = {t["name"]: Table.of(t) for t in json.loads(bfrt_json.read_text())["tables"]}
    for name, (keys, data) in PRE.items():
        tables[name] = Table(name, None, {k: (w, "Exact") for k, w in keys.items()}, {None: data})
    return tables


def _fits(table: str, field: str, value: Any, width: int) -> None:
    if width and not (isinstance(value, int) and 0 <= value < 1 << width):
        raise ValueError(f"{table}: {field} = {value!r} does not fit {width} bits")


class SchemaSession:
    """The Tofino target's session, held to ``tables``: rows kept in memory, counters all zero but where set."""

    def __init__(self, tables: dict[str, Table]) -> None:
        self.tables = tables
        self.rows: dict[str, dict[tuple, Row]] = {}
        self.counters: dict[tuple[str, int], int] = {}

    def __enter__(self) -> SchemaSession:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def _table(self, name: str) -> Table:
        if name not in self.tables:
            raise KeyError(f"no table {name} in bfrt.json")
        return self.tables[name]

    def _key(self, name: str, key: dict[str, Any]) -> tuple:
        """A key as bf_switchd takes it: every field, a (value, mask) pair where the match is ternary."""
        table = self._table(name)
        fields = {k: v for k, v in table.keys.items() if k != "$MATCH_PRIORITY"}
        if set(key) != set(fields):
            raise KeyError(f"{name}: key fields {sorted(key)}, bfrt.json has {sorted(fields)}")
        for field, value in key.items():
            width, match = fields[field]
            parts = value if match == "Ternary" else (value,)
            if match == "Ternary" and not isinstance(value, tuple):
                raise ValueError(f"{name}: {field} is a ternary match: give (value, mask)")
            for part in parts:
                _fits(name, field, part, width)
        if "$COUNTER_INDEX" in key and not key["$COUNTER_INDEX"] < table.size:
            raise IndexError(f"{name} has {table.size} counters: no index {key['$COUNTER_INDEX']}")
        return tuple(sorted(key.items()))

    def _data(self, name: str, data: dict[str, Any], action: str | None) -> None:
        table = self._table(name)
        if action not in table.actions:
            raise KeyError(f"{name}: no action {action}; bfrt.json has {sorted(map(str, table.actions))}")
        fields = table.actions[action]
        unknown = set(data) - set(fields)
        if unknown:
            raise KeyError(f"{name}: {action} has no fields {sorted(unknown)}; bfrt.json has {sorted(fields)}")
        if action is not None and set(data) != set(fields):
            raise KeyError(f"{name}: {action} needs {sorted(fields)}, got {sorted(data)}")
        for field, value in data.items():
            _fits(name, field, value, fields[field])

    def add(self, table: str, key: dict[str, Any], data: dict[str, Any], action: str | None = None) -> None:
        k = self._key(table, key)
        self._data(table, data, action)
        rows = self.rows.setdefault(table, {})
        if k in rows:
            raise ValueError(f"{table}: an entry with key {key} exists already")
        if self.tables[table].size is not None and len(rows) >= self.tables[table].size:
            raise OverflowError(f"{table} is full: {self.tables[table].size} entries")
        rows[k] = Row(dict(key), action, dict(data))

    def modify(self, table: str, key: dict[str, Any], data: dict[str, Any], action: str | None = None) -> None:
        k = self._key(table, key)
        self._data(table, data, action)
        if "$COUNTER_INDEX" in key:
            self.counters[(table, key["$COUNTER_INDEX"])] = data["$COUNTER_SPEC_PKTS"]
            return
        if k not in self.rows.get(table, {}):
            raise KeyError(f"{table}: no entry with key {key} to modify")
        self.rows[table][k] = Row(dict(key), action, dict(data))

    def delete(self, table: str, key: dict[str, Any]) -> None:
        k = self._key(table, key)
        if k not in self.rows.get(table, {}):
            raise KeyError(f"{table}: no entry with key {key} to delete")
        del self.rows[table][k]

    def entries(self, table: str) -> list[Row]:
        self._table(table)
        return list(self.rows.get(table, {}).values())

    def counter(self, table: str, index: int) -> int:
        self._key(table, {"$COUNTER_INDEX": index})
        return self.counters.get((table, index), 0)
