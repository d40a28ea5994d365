"""kvcanary.canary.observe."""
