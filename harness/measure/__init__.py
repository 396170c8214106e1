"""Measurements independent of any one point: environment, FLOPs, H2D bandwidth, timers, traces."""
