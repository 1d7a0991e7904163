"""Simulation: scripted scenarios and benchmarks on the real control plane (imports only core)."""
