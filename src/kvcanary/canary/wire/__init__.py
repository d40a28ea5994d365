"""kvcanary.canary.wire."""
