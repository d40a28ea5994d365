"""kvcanary.ops."""
