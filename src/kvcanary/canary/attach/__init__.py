"""kvcanary.canary.attach."""
