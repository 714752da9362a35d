"""`tandem report`: a run's metrics and timeline as one HTML page of plots (PNG copies beside it)."""

from tandem.report.page import write_report
from tandem.report.runs import Run, load_run

__all__ = ["Run", "load_run", "write_report"]
