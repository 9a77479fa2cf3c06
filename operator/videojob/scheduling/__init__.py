"""Scheduling: gang admission over GPU classes (pure), and the operator's view of it."""

from .scheduler import Admission, Ask, Fallback, IdleGroup, Reservation, Running, Scheduler

__all__ = ["Admission", "Ask", "Fallback", "IdleGroup", "Reservation", "Running", "Scheduler"]
