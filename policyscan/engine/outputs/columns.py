"""The columns of a score output, and the --keep checks against them: a kept input column must never replace, be
replaced by, or pass for a column policyscan writes."""
from __future__ import annotations

from policyscan.engine.settings import OptionError

ELSEWHERE = "a column policyscan writes under another option"


def output_columns(policies: list[str], layout: str, raw: bool, flagged: bool, truncation: bool) -> dict[str, str]:
    """The columns ScoreWriter writes after `id` and the kept columns, in order, each with what puts it there."""
    if layout == "long":
        on = {"policy": "--layout long", "p": "--layout long", "f": raw and "--raw", "flagged": flagged and "--flagged",
              "truncated": truncation and "--mark-truncated"}
        return {c: why for c, why in on.items() if why}
    cols = {f"p_{n}": f"the probability of policy {n!r}" for n in policies}
    cols.update({f"f_{n}": "--raw" for n in policies if raw})
    cols.update({f"flagged_{n}": "--flagged" for n in policies if flagged})
    return {**cols, **({"truncated": "--mark-truncated"} if truncation else {})}


def reserved_columns(policies: list[str], layout: str, raw: bool, flagged: bool, truncation: bool) -> dict[str, str]:
    """output_columns of this run, and every other column a score output can hold: a kept column under such a name
    would pass for policyscan's (calibrate and evaluate --from-scores read f_<policy> and p_<policy>, or policy with
    p and f as the long layout)."""
    every = {c: ELSEWHERE for lay in ("wide", "long")
             for c in output_columns(policies, lay, True, True, True)}
    return {**every, **output_columns(policies, layout, raw, flagged, truncation)}


def check_keep(keep: tuple[str, ...] | list[str], id_column: str | None, columns: dict[str, str]) -> None:
    """--keep against the output's own columns (output_columns): a kept column of the same name would replace, or be
    replaced by, the ids or the scores, so each clash is refused before anything is scored, as is a column kept
    twice (a slip for another column more often than not) or the id column kept again."""
    seen: set[str] = set()
    for k in keep:
        if k in seen:
            raise OptionError(f"--keep {k} is given twice; give each kept column once")
        seen.add(k)
        if k == "id" and id_column not in (None, "id"):
            raise OptionError(f"--keep id collides with the output column 'id', which holds the ids of --id-column "
                              f"{id_column}: the rows would get the kept values as their ids; rename the input "
                              "column 'id', or drop --keep id")
        if k == "id":
            raise OptionError("--keep id: 'id' is the output column of the ids (the input's 'id' column unless "
                              "--id-column names another); drop --keep id")
        if k == id_column:
            raise OptionError(f"--keep {k}: {k!r} is the id column (--id-column {k}), already written as the "
                              f"output column 'id'; drop --keep {k}")
        if columns.get(k) == ELSEWHERE:
            raise OptionError(f"--keep {k}: {k!r} is a column policyscan writes under another option, so the kept "
                              "values would pass for policyscan's own (calibrate and evaluate --from-scores read "
                              "f_<policy> and p_<policy>, and an output with policy and p or f columns is read as "
                              f"the long layout); rename the input column {k!r} or drop --keep {k}")
        if k in columns:
            why = columns[k]
            fixes = [f"rename the input column {k!r}", f"drop --keep {k}"] + ([f"drop {why}"] * why.startswith("--"))
            raise OptionError(f"--keep {k} collides with the output column {k!r} ({why}): one would replace the "
                              f"other; {', '.join(fixes[:-1])} or {fixes[-1]}")
