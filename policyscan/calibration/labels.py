"""Labels as people write them: 0/1, booleans, "true"/"false", or the policy's two label strings."""
from __future__ import annotations

TRUE = {"1", "true", "yes", "violation"}
FALSE = {"0", "false", "no", "compliant"}


def parse_labels(values: list, compliant: str, violation: str) -> tuple[list[int | None], list[tuple[int, str]]]:
    """(labels, problems): 1 = violation, 0 = compliant, None where the value is unusable (listed in problems)."""
    out: list[int | None] = []
    bad: list[tuple[int, str]] = []
    pos, neg = violation.strip().lower(), compliant.strip().lower()
    for i, v in enumerate(values):
        if isinstance(v, bool) or (isinstance(v, (int, float)) and v in (0, 1)):
            out.append(int(v))
            continue
        s = str(v).strip().lower() if isinstance(v, str) else None
        if s is not None and (s in TRUE or s == pos):
            out.append(1)
        elif s is not None and (s in FALSE or s == neg):
            out.append(0)
        else:
            out.append(None)
            bad.append((i, f"label {v!r} is not 0/1, a boolean, {compliant!r} or {violation!r}"))
    return out, bad
