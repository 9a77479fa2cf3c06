"""Scheduling: gang admission over GPU classes (pure), and the operator's view of it."""

from .preemption import Preemption, plan_preemptions
from .scheduler import Admission, Ask, Fallback, IdleGroup, Reservation, Running, Scheduler

__all__ = ["Admission", "Ask", "Fallback", "IdleGroup", "Preemption", "Reservation", "Running", "Scheduler",
           "plan_preemptions"]
