"""Executors, workers, model runners, models and layers: everything that runs the model."""
