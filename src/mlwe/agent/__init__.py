"""The autonomic agent: monitor, analyze, plan, execute, all through proposals.

Triggers turn telemetry and state into findings, strategies turn findings into
candidate plans, a reasoner chooses (deterministic rules by default, an LLM
optionally), a what-if on a simulated fork checks the plan beats doing
nothing, and the control plane verifies and applies it. The agent never
writes state any other way.

Wiring into a runtime engine is :mod:`mlwe.runtime.wiring` (``attach_agent``,
``attach_workflows``): the agent does not import the runtime, an outer layer.
"""
