"""Scheduling policies as small plug-ins: ordering, placement, preemption (victim
choice) and deadline admission, each a protocol with its implementations.

A :class:`mlwe.core.scheduler.Scheduler` is given its plug-ins explicitly, as
arguments (no registry, no import side effects); the replays' named schedulers,
which combine them, are registered in :data:`mlwe.sim.baselines.POLICIES`.
"""
