"""Trade-off reports (``tensoropt report``): what a search's frontier means for a user.

``analysis`` derives the answers (frontier per device count, fastest plan per memory
capacity, fewest devices per step-time target, reference plans against the frontier),
``strategies`` how unit strategies change along a frontier, ``plots`` the figures,
``render`` the markdown, ``build`` the all-or-nothing report directory.
"""

from tensoropt.report.build import ReportOptions, write_report
from tensoropt.report.render import Header

__all__ = ["Header", "ReportOptions", "write_report"]
