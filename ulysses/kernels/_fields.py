"""Grid values declared once, by name: one :class:`GridFields` record a kernel.

A kernel that reads its grid values (strides, sizes, offsets) from one int table
(``kernels/_scratch.grid_table``) declares them here as a record of names, in table order.
Both sides come from that record:

* the host packs a section by name (``_scratch.Section(record, {name: value})``: every
  field given, none extra), in the record's order;
* the kernel reads a field at its named offset, a module-level ``tl.constexpr`` named after
  the field, made by :meth:`GridFields.at` (``_KS_row0 = K_STATS.at("row0")``) or
  :meth:`GridFields.offsets` (every field in order), then ``tl.load(values_ptr + _KS_row0)``.
  Triton hashes a constexpr global's value into the kernel's cache key, so a record that
  changes recompiles its kernels.

No kernel reads its table at a bare number (``tests/unit/test_grid_fields.py``).
"""

from __future__ import annotations

import triton.language as tl

__all__ = [
    "GridFields",
    "ROW_divisor",
    "ROW_FIELDS",
    "ROW_live_end",
    "ROW_tail_group",
    "ROW_WIDTH",
    "starts",
]


class GridFields:
    """The names of one kernel's grid values, in the order of its table. ``hinted``: the
    fields Triton would have specialized as parameters (strides, row sizes), whose
    divisibility by 16 the kernel is told (``_tl.table_int``). A field ``rows_at`` is
    filled in by ``grid_table``: where the section's per-row table starts, counted from the
    section's first entry."""

    __slots__ = ("names", "hinted", "_index")

    def __init__(self, *names: str, hinted: tuple[str, ...] = ()) -> None:
        assert names and len(set(names)) == len(names), names
        assert set(hinted) <= set(names), sorted(set(hinted) - set(names))
        self.names, self.hinted = names, frozenset(hinted)
        self._index = {n: i for i, n in enumerate(names)}

    def __len__(self) -> int:
        return len(self.names)

    def __repr__(self) -> str:
        return f"GridFields{self.names}"

    def index(self, name: str) -> int:
        """Where field ``name`` sits in the record's section."""
        return self._index[name]

    def at(self, name: str) -> tl.constexpr:
        """The kernel's offset of field ``name``: a ``tl.constexpr`` for a module global."""
        return tl.constexpr(self._index[name])

    def offsets(self) -> tuple[tl.constexpr, ...]:
        """Every field's offset in the record's order, for a kernel module's constants
        (``(_KS_stride_kb, _KS_stride_kl, ...) = K_STATS.offsets()``: each constant named
        after its field, which ``tests/unit/test_grid_fields.py`` checks)."""
        return tuple(tl.constexpr(i) for i in range(len(self.names)))

    def pack(self, values: dict) -> list:
        """The section's entries, ``values`` (every field, by name) in the record's order."""
        missing, extra = set(self.names) - set(values), set(values) - set(self.names)
        assert not missing and not extra, (
            f"{self}: missing {sorted(missing)}, extra {sorted(extra)}"
        )
        return [values[n] for n in self.names]


def starts(*records: GridFields) -> tuple[tl.constexpr, ...]:
    """Where each record's section starts in a table of these sections, one after another
    (``grid_table``'s layout): the offsets a fused kernel hands each kind of program."""
    out, at = [], 0
    for record in records:
        out.append(tl.constexpr(at))
        at += len(record)
    return tuple(out)


# The per-row table (``ulysses.grid.row_values``): one row of these values a batch row, read
# by kernels built with ``PER_ROW`` at ``rows_ptr + i_b * ROW_WIDTH``.
ROW_FIELDS = GridFields("live_end", "tail_group", "divisor")
ROW_live_end = ROW_FIELDS.at("live_end")
ROW_tail_group = ROW_FIELDS.at("tail_group")
ROW_divisor = ROW_FIELDS.at("divisor")
ROW_WIDTH = tl.constexpr(len(ROW_FIELDS))
