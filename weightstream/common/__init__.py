"""Foundation: bounds on waits, processes, byte layout, staged output directories, HF checkpoint files."""
