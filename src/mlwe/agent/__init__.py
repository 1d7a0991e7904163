"""The autonomic agent: monitor, analyze, plan, execute, all through proposals.

Triggers turn telemetry and state into findings, strategies turn findings into
candidate plans, a reasoner chooses (deterministic rules by default, an LLM
optionally), a what-if on a simulated fork checks the plan beats doing
nothing, and the control plane verifies and applies it. The agent never
writes state any other way.
"""

from typing import Any

#: What the runtime wiring imports (loaded on first use: ``import mlwe.agent.codec``
#: should not pull in the whole loop).
__all__ = ["attach", "attach_workflows", "detach_workflows"]


def __getattr__(name: str) -> Any:
    if name == "attach":
        from mlwe.agent.loop import attach

        return attach
    if name in ("attach_workflows", "detach_workflows"):
        from mlwe.agent import workflows

        return getattr(workflows, name)
    raise AttributeError(f"module 'mlwe.agent' has no attribute {name!r}")
