"""Per-op sharding rules (one module per op family) and their registry.

Public API::

    from tensoropt.rules.sharding import (
        SHARDING_RULES, OpView, OpSharding, LocalOp, MeshSharding,
        strategies_nd, strategies_2d, localize_nd, resolve_unit,
    )

See docs/design/sharding.md.
"""

from tensoropt.rules.sharding.base import (
    FactorRule,
    FactorSpec,
    LocalOp,
    OpSharding,
    OpView,
    Reduction,
    ShardingRule,
)
from tensoropt.rules.sharding.registry import (
    SHARDING_RULES,
    MeshSharding,
    ShardingRegistry,
    local_view,
    localize_nd,
    resolve_unit,
    strategies_2d,
    strategies_nd,
)

__all__ = [
    "SHARDING_RULES",
    "FactorRule",
    "FactorSpec",
    "LocalOp",
    "MeshSharding",
    "OpSharding",
    "OpView",
    "Reduction",
    "ShardingRegistry",
    "ShardingRule",
    "local_view",
    "localize_nd",
    "resolve_unit",
    "strategies_2d",
    "strategies_nd",
]
