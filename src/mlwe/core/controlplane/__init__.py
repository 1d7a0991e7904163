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
lifecycle transitions, in order), and an :class:`Effects` record (those
transitions, the workloads, nodes and queues it changed, the decision records
filed with it) in ``ControlPlane.effects``, an :class:`EffectsLog` that keeps
every batch's record, whoever applied it, for each reader that follows it,
with a cursor of its own: the reconciler (through
:meth:`ControlPlane.take_effects`: what is owed to the backend) and the store
writer (:class:`mlwe.store.recovery.StoreWriter`: what to write at a flush). A
decision record filed outside a batch (a rejection, a changed pending reason)
is a record of its own. A batch undone by :meth:`ControlPlane.rollback_to` is
gone from the log for every reader. ``listeners`` and ``decision_listeners``
remain for observers that need a push (monitors, metrics, recent decisions).

Readers that keep what they read of workloads across scheduling cycles (the
gain test's holders, the size-aware order of the queue) ask instead which
workloads changed since a mark: :meth:`ControlPlane.changed_since` reads a
bounded journal of the ids every applied batch changed, and answers None (read
everything again) after a rollback or a restore, or once the journal has
started over. Each hold on a node is numbered, so :meth:`ControlPlane.hold_key`
gives a holder's place in the holder order without a pass over every holder.
"""


from mlwe.core.controlplane.effects import Changed, Effects, EffectsLog
from mlwe.core.controlplane.plane import ControlPlane
from mlwe.core.controlplane.state import (
    DEFAULT_QUEUE,
    NOT_ITS_FAULT,
    ApplyResult,
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
    "Effects",
    "EffectsLog",
    "InvariantViolation",
    "Rejection",
    "Savepoint",
    "could_hold",
    "priority_index",
]
