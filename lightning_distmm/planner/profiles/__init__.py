"""What one sample costs a tower: analytic profiles from model configs, built from transformer blocks."""
