"""Cost model: cluster profiles, per-op compute estimates, and cost problems.

``tensoropt.cost.model.build_problem`` turns a forward graph on a mesh into the
:class:`~tensoropt.ir.costs.CostProblem` that Frontier Tracking solves.
"""
