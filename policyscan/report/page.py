"""One self-contained HTML page: inline styles, inline SVG, no script and nothing fetched (a content security
policy forbids every load, so a page that tried would say so in the browser's console). Every text is escaped."""
from __future__ import annotations

import datetime
import re
from html import escape

from policyscan.engine.settings import version

CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:#1d2125;margin:0;background:#f6f7f9}
main{max-width:1120px;margin:0 auto;padding:20px 28px 60px}
h1{font-size:22px;margin:8px 0 2px}h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #d5d9de;
padding-bottom:4px}h3{font-size:15px;margin:18px 0 6px}
.sub{color:#5b636b;margin:0 0 12px}.note{color:#5b636b;font-size:13px}.warn{color:#a61e1e;font-weight:600}
table{border-collapse:collapse;margin:6px 0 10px;background:#fff;font-size:13px}
th,td{border:1px solid #dde1e5;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#eef1f4;font-weight:600}td.n{text-align:right;font-variant-numeric:tabular-nums}
td.x{max-width:520px;white-space:pre-wrap;word-break:break-word;font-size:12px;color:#343a40}
code,.h{font-family:ui-monospace,SFMono-Regular,Menlo,monospace;font-size:12px;word-break:break-all}
.cards{display:flex;flex-wrap:wrap;gap:10px;margin:8px 0}
.card{background:#fff;border:1px solid #dde1e5;border-radius:6px;padding:8px 14px;min-width:150px}
.card b{display:block;font-size:20px}.card span{color:#5b636b;font-size:12px}
.plots{display:flex;flex-wrap:wrap;gap:12px}.plots svg{background:#fff;border:1px solid #dde1e5;border-radius:4px}
svg .t{font-size:13px;font-weight:600}svg .l{font-size:11px;fill:#343a40}svg .k{font-size:10px;fill:#495057}
svg .frame{fill:none;stroke:#adb5bd}svg .grid{stroke:#e9ecef}svg .ax{stroke:#868e96}
svg .bar{fill:#4c86c6}svg .thr{stroke:#c92a2a;stroke-width:1.5;stroke-dasharray:5 3}svg .thrt{fill:#c92a2a}
svg .diag{stroke:#adb5bd;stroke-dasharray:3 3}svg .mark{fill:none;stroke:#c92a2a;stroke-width:2}
"""
_HEX = re.compile(r"[0-9a-f]{32,}")  # a hash: shown in monospace
# nothing may load: not a script, a font, an image or a style from anywhere
CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:"


def document(title: str, subtitle: str, body: list[str]) -> str:
    """The whole page; `body` is HTML already escaped where it holds data."""
    made = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<meta http-equiv=\"Content-Security-Policy\" content=\"{CSP}\">"
            "<meta name=\"viewport\" content=\"width=device-width,initial-scale=1\">"
            f"<title>{escape(title)}</title><style>{CSS}</style></head><body><main>"
            f"<h1>{escape(title)}</h1><p class=\"sub\">{escape(subtitle)} &middot; written {escape(made)} by "
            f"policyscan {escape(version())}</p>" + "\n".join(body) + "</main></body></html>\n")


def cell(value, data: dict[str, str] | None = None, digits: int = 4) -> str:
    """A table cell: numbers right-aligned (floats to `digits` decimals, None as n/a), text escaped; `data` becomes
    data-* attributes that name what the cell shows (tests and scripts read them)."""
    attrs = "".join(f' data-{escape(k)}="{escape(str(v))}"' for k, v in (data or {}).items())
    if value is None:
        return f'<td class="n"{attrs}>n/a</td>'
    if isinstance(value, bool):
        return f"<td{attrs}>{'yes' if value else 'no'}</td>"
    if isinstance(value, int):
        return f'<td class="n"{attrs}>{value:,}</td>'
    if isinstance(value, float):
        return f'<td class="n"{attrs}>{value:.{digits}f}</td>'
    return f"<td{attrs}>{escape(str(value))}</td>"


def table(headers: list[str], rows: list[list[str]]) -> str:
    """rows: lists of cells as cell() writes them."""
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def pairs(items: list[tuple[str, object]]) -> str:
    """A two-column table of names and values (hashes and paths in monospace)."""
    rows = []
    for name, value in items:
        text = "n/a" if value is None else str(value)
        mono = " class=\"h\"" if isinstance(value, str) and (_HEX.fullmatch(value) or "/" in value) else ""
        rows.append(f"<tr><th>{escape(name)}</th><td{mono}>{escape(text)}</td></tr>")
    return f"<table><tbody>{''.join(rows)}</tbody></table>"


def cards(items: list[tuple[str, str, dict[str, str] | None]]) -> str:
    """Big figures: (value, what it is, data-* attributes)."""
    out = []
    for value, label, data in items:
        attrs = "".join(f' data-{escape(k)}="{escape(str(v))}"' for k, v in (data or {}).items())
        out.append(f'<div class="card"><b{attrs}>{escape(value)}</b><span>{escape(label)}</span></div>')
    return f'<div class="cards">{"".join(out)}</div>'


def section(title: str, parts: list[str], anchor: str | None = None) -> str:
    ident = f' id="{escape(anchor)}"' if anchor else ""
    return f"<section{ident}><h2>{escape(title)}</h2>{''.join(parts)}</section>"


def para(text: str, cls: str = "note") -> str:
    return f'<p class="{cls}">{escape(text)}</p>'
