"""kvcanary.canary.report."""
