"""Trained draft heads on the target itself: Medusa and EAGLE, their training data and training."""
