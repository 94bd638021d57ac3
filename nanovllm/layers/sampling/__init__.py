"""Sampling on the device: the sampler, penalties, logit steering and structured outputs' token
bitmask."""
