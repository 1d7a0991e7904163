"""Simulation: scripted scenarios and benchmarks on the real control plane (imports only core).

The simulated backend is :mod:`mlwe.sim.backend` on the kernel's time, and
:mod:`mlwe.sim.live` on an engine's clock (``mlwe serve --backend sim``).
"""
