"""kvcanary.canary.kernels.dispatch."""
