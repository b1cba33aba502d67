"""The engine as a unit: one scheduler composed with its worker ranks.

The worker follows plans and never schedules, so nothing in ``services/worker``
imports the scheduler; whatever puts the two together lives here: the offline
engine (``offline.LLM``, scheduler and model runner in one process), its
benchmarks, and an engine's registration in Redis for the gateways' router.
"""
