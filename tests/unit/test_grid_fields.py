"""Each kernel's grid values are declared once, as a record of named fields
(``kernels/_fields.GridFields``): the host packs a table by name, the kernel reads each field
at the offset its record names. A value packed by name reads back at the kernel's offset of
that name, in every record and in the fused launches' tables; no kernel reads its table at a
bare number."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import re

import pytest
import torch
import triton.language as tl

import ulysses.kernels
from ulysses.kernels._fields import ROW_FIELDS, GridFields
from ulysses.kernels._scratch import Section, grid_table

CPU = torch.device("cpu")


def _modules():
    return [
        importlib.import_module(f"ulysses.kernels.{m.name}")
        for m in pkgutil.iter_modules(ulysses.kernels.__path__)
    ]


def _records() -> dict[str, GridFields]:
    """Every record of the kernels, by the name its module gives it."""
    found = {}
    for module in _modules():
        for name, obj in vars(module).items():
            if isinstance(obj, GridFields) and obj not in found.values():
                found[f"{module.__name__}.{name}"] = obj
    return found


def _offsets(source: str, records: dict | None = None) -> list[tuple[str, str, str]]:
    """(constant, record, field) of each ``CONSTANT = RECORD.at("field")`` and of each
    ``(C0, C1, ...) = RECORD.offsets()`` in ``source`` (field i of the record, from
    ``records``: name -> GridFields)."""
    out = []
    for node in ast.parse(source).body:  # module level
        if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)):
            continue
        call, target = node.value, node.targets[0]
        if not isinstance(call.func, ast.Attribute) or call.func.attr not in ("at", "offsets"):
            continue
        rec = call.func.value.id
        if call.func.attr == "at":
            out.append((target.id, rec, call.args[0].value))
        elif call.func.attr == "offsets":
            names = (records or {})[rec].names
            consts = [t.id for t in target.elts]
            assert len(consts) == len(names), (rec, consts)
            out += [(c, rec, f) for c, f in zip(consts, names, strict=True)]
    return out


def _misnamed(source: str, records: dict | None = None) -> list[str]:
    """Offsets whose constant does not end with the field it reads (``_KS_row0`` reads
    ``row0``): a constant bound to the wrong field."""
    found = _offsets(source, records)
    return [f"{c} = {r}: {f!r}" for c, r, f in found if not c.endswith(f"_{f}")]


def _values(record: GridFields) -> dict:
    """A distinct value per field: hinted fields alternate multiples of 16 and others."""
    return {n: 1000 + 16 * i + (i % 2) for i, n in enumerate(record.names) if n != "rows_at"}


def test_the_records_are_found():
    names = {k.rsplit(".", 1)[1] for k in _records()}
    expected = {"K_STATS", "QV_STATS", "LOWP_STATS", "FINALIZE", "LOWP_FINISH", "POST_GATHER"}
    expected |= {"PACK", "DEQUANT", "ROW_FIELDS"}
    assert expected <= names, sorted(expected - names)


@pytest.mark.parametrize("name", sorted(_records()))
def test_a_record_packs_by_name_and_reads_back_at_its_offsets(name):
    record = _records()[name]
    values = _values(record)
    rows = ((7, 8, 9), (10, 11, 12)) if "rows_at" in record.names else None
    table, hints = grid_table((Section(record, values, rows),), CPU)
    table = table.tolist()
    for field in record.names:
        at = record.index(field)
        assert tl.constexpr(at) == record.at(field) and at == record.names.index(field)
        if field == "rows_at":  # the per-row table follows the values
            assert table[table[at] :] == [7, 8, 9, 10, 11, 12]
        else:
            assert table[at] == values[field], field
            hinted = field in record.hinted and values[field] % 16 == 0
            assert (hints >> at) & 1 == hinted, field


def test_every_kernel_offset_reads_its_field():
    """Each kernel module's named offsets, read in a table packed by name."""
    seen = 0
    for module in _modules():
        source = inspect.getsource(module)
        records = {n: r for n, r in vars(module).items() if isinstance(r, GridFields)}
        assert not _misnamed(source, records), (module.__name__, _misnamed(source, records))
        for const, rec, field in _offsets(source, records):
            record = getattr(module, rec)
            values = _values(record)
            rows = ((0, 0, 0),) if "rows_at" in record.names else None
            table = grid_table((Section(record, values, rows),), CPU)[0].tolist()
            offset = getattr(module, const)
            assert isinstance(offset, tl.constexpr), const
            if field != "rows_at":
                assert table[offset.value] == values[field], (module.__name__, const)
            seen += 1
    assert seen > 100


@pytest.mark.parametrize(
    "module, head, parts",
    [
        ("lowp_stats", "LOWP_STATS", (("_LS_K_AT", "K_STATS"), ("_LS_QV_AT", "QV_STATS"))),
        ("lowp_finish", "POST_GATHER", (("_PG_FINALIZE_AT", "FINALIZE"), ("_PG_FINISH_AT", None))),
    ],
)
def test_a_fused_table_reads_each_section_at_its_start(module, head, parts):
    """The fused launches hand each kind of program its section's start: the section's
    values read back there by their record's offsets, with their hints."""
    mod = importlib.import_module(f"ulysses.kernels.{module}")
    records = [getattr(mod, head)]
    records += [getattr(mod, rec or "LOWP_FINISH") for _, rec in parts]
    values = [{n: 100 * j + 16 * i + 1 for i, n in enumerate(r.names) if n != "rows_at"}
              for j, r in enumerate(records)]  # fmt: skip
    for v, r in zip(values, records, strict=True):
        if "stride_kb" in r.names:
            v["stride_kb"] = 64  # a hinted multiple of 16
    sections = [
        Section(r, v, ((1, 2, 3),) if "rows_at" in r.names else None)
        for r, v in zip(records, values, strict=True)
    ]
    table, hints = grid_table(tuple(sections), CPU)
    table = table.tolist()
    for (start, _), record, v in zip(parts, records[1:], values[1:], strict=True):
        base = getattr(mod, start).value
        for field, x in v.items():
            assert table[base + record.index(field)] == x, (start, field)
            if field in record.hinted:
                assert (hints >> base >> record.index(field)) & 1 == (x % 16 == 0)
        if "rows_at" in record.names:
            assert table[base + table[base + record.index("rows_at")]] == 1


def test_the_row_table_is_the_grid_rule_in_record_order():
    from ulysses import grid

    rows = grid.row_values((5, 130), 256, 64)
    for used, row in zip((5, 130), rows, strict=True):
        assert row[ROW_FIELDS.index("live_end")] == used
        assert row[ROW_FIELDS.index("tail_group")] == grid.tail_group(used, 256, 64)
        assert row[ROW_FIELDS.index("divisor")] == grid.mean_divisor(used, 256)


def test_a_section_must_name_every_field():
    record = GridFields("a", "b")
    with pytest.raises(AssertionError, match="missing"):
        grid_table((Section(record, {"a": 1}),), CPU)
    with pytest.raises(AssertionError, match="extra"):
        grid_table((Section(record, {"a": 1, "b": 2, "c": 3}),), CPU)


# a table read at a bare number: ``values_ptr + 22``, ``table_int(values_ptr, 5, ...)``, the
# table's first entry unnamed, a per-row table's row width or field by number
_BARE = re.compile(
    r"values_ptr\s*\+\s*\d|table_int\(\s*\w+\s*,\s*\d|tl\.load\(\s*values_ptr\s*\)"
    r"|rows_ptr\s*\+\s*i_b\s*\*\s*\d|rows_ptr\s*\+\s*i_b\s*\*\s*\w+\s*\+\s*\d"
)


def _bare_loads(source: str) -> list[str]:
    return [line.strip() for line in source.splitlines() if _BARE.search(line)]


def test_no_kernel_reads_its_table_at_a_bare_number():
    for module in _modules():
        found = _bare_loads(inspect.getsource(module))
        assert not found, (module.__name__, found)


def test_the_checks_see_a_planted_fault():
    """Planted: a bare numbered load, and a constant bound to another field."""
    assert _bare_loads("    n = tl.load(values_ptr + 22)\n")
    assert _bare_loads("    s = table_int(values_ptr, 3, HINTS)\n")
    assert _bare_loads("    t = tl.load(rows_ptr + i_b * ROW_WIDTH + 1)\n")
    assert not _bare_loads("    n = tl.load(values_ptr + _KS_row0)\n")
    assert _misnamed('_KS_row0 = K_STATS.at("used")\n')
    assert not _misnamed('_KS_row0 = K_STATS.at("row0")\n')
    ab = {"AB": GridFields("a", "b")}
    assert _misnamed("(_X_b, _X_a) = AB.offsets()\n", ab)  # in the other order
    assert not _misnamed("(_X_a, _X_b) = AB.offsets()\n", ab)
