"""Support for checks: Megatron-Core models built on the CPU, and checkpoint comparison."""
