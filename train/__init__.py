"""Training on the same model and mesh: data, step, checkpoints and export."""
