"""The control plane: the single writer of cluster state.

``apply(actions, expected_version)`` verifies every action of a batch against
the state as the earlier actions of the same batch leave it, and applies all
of them or none: each mutation records how to undo itself, and any rejection
rolls the batch back. Verification covers capacity per node and resource,
GPU model and VRAM fit, gang completeness, node state, lifecycle edges, the
preemption rule, quotas, ids and quantities. A rejection is a value listing
every reason; it never raises.

After each applied batch the invariants of what the batch touched are checked
(``check_invariants``); :meth:`validate_state` is the full sweep.

What an applied batch did leaves as a value: ``ApplyResult.transitions`` (its
lifecycle transitions, in order), and, for a reader that asked
(:meth:`ControlPlane.keep_effects`: the reconciler), the same values of every
batch until :meth:`ControlPlane.take_effects`, whoever applied them; a batch
undone by :meth:`ControlPlane.rollback_to` is gone from them. ``listeners``
remain for observers that need a push (the store writer, monitors, metrics).
"""


from mlwe.core.controlplane.plane import ControlPlane
from mlwe.core.controlplane.state import (
    DEFAULT_QUEUE,
    NOT_ITS_FAULT,
    ApplyResult,
    Changed,
    InvariantViolation,
    Rejection,
    Savepoint,
    could_hold,
    priority_index,
)

__all__ = [
    "DEFAULT_QUEUE",
    "NOT_ITS_FAULT",
    "ApplyResult",
    "Changed",
    "ControlPlane",
    "InvariantViolation",
    "Rejection",
    "Savepoint",
    "could_hold",
    "priority_index",
]
