"""kvcanary.ops.cpu."""
