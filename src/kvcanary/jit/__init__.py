"""kvcanary.jit."""
