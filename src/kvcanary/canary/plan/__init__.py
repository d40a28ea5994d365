"""kvcanary.canary.plan.reference."""
