"""The checks a conversion is proven by: two HF checkpoints compared tensor by tensor (``weightstream verify``,
``convert --verify``), and Megatron-Core models built on the CPU from an HF config and loaded from its checkpoint,
whose logits are compared with the HF model's (``demo``, ``example``, ``bench`` and the tests run them)."""
