"""What-if analysis: failures and goodput, perturbed hardware, run-to-run variability."""
