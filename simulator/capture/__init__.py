"""Capture: run real torch workloads (gloo on CPU, NCCL on GPUs) and write trace bundles.

This is the only package that imports torch, and it does so lazily: ``simulator.capture.cli``
is importable without torch; ``harness``, ``collectives``, ``compute`` and ``train`` import it.
"""
