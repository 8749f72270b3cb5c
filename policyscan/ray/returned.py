"""What Ray returned of one output's units, checked against the plan as it arrives.

`score --ray` counts an output's rows from what comes back, so that count alone cannot show a row Ray lost (a
batch retried after its actor died, say). Each unit's rows therefore come back in order from the unit's first
file row, each once, and close with one row that counts them: the reader's end row, or the failed row of a file
that could not be read further. A unit that is short, doubled, out of order, or never closed fails the output,
which is then not written."""
from __future__ import annotations

import numpy as np

from policyscan.engine.errors import PolicyscanError
from policyscan.engine.inputs.units import Unit


class ReturnedRows:
    """One output's units (in run order); see() each returned table's SOURCE fields, then finish()."""

    def __init__(self, units: list[Unit]):
        self.first = {u.index: u.part.file_rows.start if u.part is not None else 0 for u in units}
        self.path = {u.index: u.path for u in units}
        self.order = [u.index for u in units]
        self.place = {u: i for i, u in enumerate(self.order)}
        self.next: dict[int, int] = {}  # of each unit begun: the file row its next row must have
        self.closed: set[int] = set()
        self.at = -1  # the place in `order` of the unit rows last came from

    def see(self, unit: np.ndarray, row: np.ndarray, closes: np.ndarray) -> None:
        """Rows in the order they came: their unit, file row (a closing row's: the unit's rows before it), and
        whether each closes its unit."""
        edges = [0, *(np.flatnonzero(unit[1:] != unit[:-1]) + 1), len(unit)]
        for lo, hi in zip(edges, edges[1:]):
            if hi > lo:
                self._run(int(unit[lo]), row[lo:hi], closes[lo:hi])

    def finish(self) -> None:
        """Every unit closed: raises naming the first that is not."""
        for u in self.order:
            if u not in self.closed:
                self._fail(u, "never came back whole" if u in self.next else "never came back")

    def _run(self, u: int, rows: np.ndarray, closes: np.ndarray) -> None:
        if u not in self.first:
            raise PolicyscanError(f"the Ray run returned rows of unit {u}, which is not this output's: nothing of "
                                  "it is written; run the command again")
        if u in self.closed:
            self._fail(u, "came back twice")
        place = self.place[u]
        if place != self.at:  # a new unit: the one before it closed, and none skipped
            if self.at >= 0 and self.order[self.at] not in self.closed:
                self._fail(self.order[self.at], "never came back whole")
            if place != self.at + 1:
                self._fail(self.order[self.at + 1], "never came back")
            self.at = place
        if closes[:-1].any():
            self._fail(u, "has rows after its end")
        start = self.next.get(u, self.first[u])
        body = rows[:-1] if closes[-1] else rows
        if not np.array_equal(body, np.arange(start, start + len(body))):
            self._fail(u, f"came back with rows out of place (expected from file row {start})")
        self.next[u] = start + len(body)
        if closes[-1]:
            got, said = self.next[u] - self.first[u], int(rows[-1])
            if got != said:
                self._fail(u, f"came back with {got} of its {said} rows")
            self.closed.add(u)

    def _fail(self, u: int, what: str) -> None:
        raise PolicyscanError(f"{self.path[u]}: the part from file row {self.first[u]} {what} from the Ray run; "
                              "the output is not written: run the command again")
