"""HTML pieces of the run report (moe_rl.app.report): sections, figure rows, tables, the page's CSS."""
from __future__ import annotations

import reprlib
from html import escape as esc

MAX_TABLE_ROWS = 200
MAX_CELL_CHARS = 2000
_BOUNDED = reprlib.Repr()
_BOUNDED.maxlevel, _BOUNDED.maxdict, _BOUNDED.maxlist, _BOUNDED.maxtuple = 4, 30, 30, 30
_BOUNDED.maxset, _BOUNDED.maxfrozenset, _BOUNDED.maxstring, _BOUNDED.maxother = 30, 30, 400, 400

CSS = """body{font-family:sans-serif;margin:16px;max-width:1320px;color:#222}
h1{font-size:20px;margin:0 0 4px}h2{font-size:16px;margin:22px 0 6px;border-bottom:1px solid #ccc}
h3{font-size:13px;margin:10px 0 4px}.sub{color:#666;font-size:12px;margin:0 0 10px}
.figs{display:flex;flex-wrap:wrap;gap:10px;align-items:flex-start}
table{border-collapse:collapse;font-size:12px;margin:4px 0}td,th{border:1px solid #ddd;padding:2px 6px;
text-align:left;vertical-align:top}th{background:#f4f4f4}td.pre{white-space:pre-wrap;font-family:monospace}
.nr{color:#888;font-style:italic}.note{color:#b00}"""


def section(title: str, parts) -> str:
    return f"<section><h2>{esc(title)}</h2>\n" + "\n".join(parts) + "\n</section>"


def fig_row(svgs) -> str:
    return '<div class="figs">' + "\n".join(svgs) + "</div>"


def not_recorded(what: str) -> str:
    return f'<p class="nr">not recorded: {esc(what)}</p>'


def fmt(v) -> str:
    """A cell's text, at most MAX_CELL_CHARS: a value from a run's config.yaml may be any structure,
    and a nested one is shown through reprlib's bounded repr (the same text as str() when small)."""
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.4g}"
    text = _BOUNDED.repr(v) if isinstance(v, (dict, list, tuple, set, frozenset)) else str(v)
    return text if len(text) <= MAX_CELL_CHARS else text[:MAX_CELL_CHARS] + "…"


def table(header, rows, pre: tuple = ()) -> str:
    """rows: sequences of cells; columns whose index is in `pre` keep their line breaks."""
    out = ["<table><tr>" + "".join(f"<th>{esc(h)}</th>" for h in header) + "</tr>"]
    for r in rows[:MAX_TABLE_ROWS]:
        out.append("<tr>" + "".join(f'<td{" class=pre" if i in pre else ""}>{esc(fmt(v))}</td>'
                                    for i, v in enumerate(r)) + "</tr>")
    out.append("</table>")
    if len(rows) > MAX_TABLE_ROWS:
        out.append(f'<p class="sub">{len(rows) - MAX_TABLE_ROWS} more rows not shown</p>')
    return "".join(out)
