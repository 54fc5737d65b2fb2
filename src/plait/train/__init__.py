"""Training: data, optimisation and the training loop."""
