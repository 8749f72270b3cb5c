"""Labels as people write them: 0/1, booleans, "true"/"false", yes/no, or the policy's two label strings."""
from __future__ import annotations

TRUE = {"1", "true", "yes", "violation"}
FALSE = {"0", "false", "no", "compliant"}


def parse_labels(values: list, compliant: str, violation: str) -> tuple[list[int | None], list[tuple[int, str]]]:
    """(labels, problems): 1 = violation, 0 = compliant, None where the value is unusable (listed in problems). The
    policy's own label strings come first: a policy whose compliant label is " Yes" reads "yes" as compliant
    (label_words_note says so)."""
    out: list[int | None] = []
    bad: list[tuple[int, str]] = []
    pos, neg = violation.strip().lower(), compliant.strip().lower()
    for i, v in enumerate(values):
        if isinstance(v, bool) or (isinstance(v, (int, float)) and v in (0, 1)):
            out.append(int(v))
            continue
        s = str(v).strip().lower() if isinstance(v, str) else None
        if s is not None and s in (pos, neg):
            out.append(int(s == pos))
        elif s is not None and s in TRUE:
            out.append(1)
        elif s is not None and s in FALSE:
            out.append(0)
        else:
            out.append(None)
            bad.append((i, f"label {v!r} is not 0/1, a boolean, {compliant!r} or {violation!r}"))
    return out, bad


def label_words_note(name: str, compliant: str, violation: str) -> str | None:
    """A line to print where the policy's label strings are words that mean the other class elsewhere (a compliant
    " Yes", a violation " No"): such labels are read as the policy's, which a reader of the file should know."""
    flipped = [(w, "compliant") for w in [compliant.strip().lower()] if w in TRUE] + \
        [(w, "violation") for w in [violation.strip().lower()] if w in FALSE]
    if not flipped:
        return None
    said = " and ".join(f"{w!r} as {what}" for w, what in flipped)
    return (f"{name}: its labels are {compliant!r} (compliant) and {violation!r} (violation), so labels read {said}, "
            "as the policy's own strings, not as the words 0/1, true/false and yes/no usually mean")
