"""What the tests share: multi-process workers, comparisons of what engines hold, saved Megatron checkpoints."""
