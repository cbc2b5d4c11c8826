"""The scheduling policy: who runs each step with which tokens, and what the step's results make of
each request. No torch, no device. `policy.py` is the whole of it as the core sees it; the rest
are its parts: `admission` (can a request run here), `planner` (the plan: decodes, prefill chunks,
admissions, KV and preemption), `verify_budget` (`compact`'s verify lengths), `forks` (the
choices of `n` > 1), `outputs` (what each step returns per request), `running` and `sequence` (the
state they share)."""

from services.scheduler.plan import SeqResult, SeqStep, StepPlan
from services.scheduler.policy.config import PolicyConfig
from services.scheduler.policy.policy import Policy

__all__ = ["Policy", "PolicyConfig", "SeqResult", "SeqStep", "StepPlan"]
