"""`tandem report`: one self-contained HTML page of a run's plots (several runs overlaid), with a
PNG copy of each plot beside it."""

import base64
import html
import io
from pathlib import Path

import matplotlib.pyplot as plt

from tandem.report.figures import PLOTS
from tandem.report.runs import Run, load_run


def summary_table(runs: list[Run]) -> str:
    """A row per run: steps, held-out accuracy at the start and the end, wall time."""
    rows = []
    for run in runs:
        _, acc = run.series("val/accuracy", "val")
        start, end = (f"{100 * acc[0]:.1f}%", f"{100 * acc[-1]:.1f}%") if acc else ("-", "-")
        seconds = max(run.wall_time().values())
        rows.append(
            f"<tr><td>{html.escape(run.name)}</td><td>{len(run.train)}</td><td>{start}</td><td>{end}</td>"
            f"<td>{seconds:.0f} s</td></tr>"
        )
    head = (
        "<tr><th>run</th><th>train steps</th><th>accuracy at start</th><th>at end</th><th>wall time</th></tr>"
    )
    return f"<table>{head}{''.join(rows)}</table>"


def write_report(run_dirs: list[str | Path], out: str | Path) -> list[Path]:
    """The page at `out` and its PNGs in `<out stem>_png/` -> the PNG files written."""
    runs = [load_run(d) for d in run_dirs]
    out = Path(out)
    png_dir = out.with_name(out.stem + "_png")
    png_dir.mkdir(parents=True, exist_ok=True)
    sections, written = [], []
    for plot in PLOTS:
        fig = plot.make(runs)
        if fig is None:
            sections.append(f"<h2>{plot.title}</h2><p class='none'>No run has data for this plot.</p>")
            continue
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", dpi=100)
        plt.close(fig)
        (png_dir / f"{plot.name}.png").write_bytes(buffer.getvalue())
        written.append(png_dir / f"{plot.name}.png")
        data = base64.b64encode(buffer.getvalue()).decode()
        sections.append(f"<h2>{plot.title}</h2><img alt='{plot.name}' src='data:image/png;base64,{data}'>")
    names = ", ".join(html.escape(r.name) for r in runs)
    out.write_text(
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>tandem report: {names}</title><style>"
        "body{font-family:sans-serif;margin:2em;max-width:1500px}img{max-width:100%}"
        "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:4px 10px}.none{color:#888}"
        f"</style></head><body><h1>tandem report: {names}</h1>{summary_table(runs)}{''.join(sections)}"
        "</body></html>"
    )
    return written
