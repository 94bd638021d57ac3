"""Persistent kernels: a decode layer in one launch, phases separated by grid barriers."""
