"""The train step, its optimizer and train-state construction."""
