"""Sequences (issue 39): reading, the leave-one-out split, encoders, next-item objectives and
evaluation, as library pieces apart from the engine."""
