"""A model as files become a model in memory: ``loading`` (the spec and the load), ``serving_properties``,
``user_code`` (with ``code_fetcher`` from S3 and ``dependencies``), ``pt2`` and ``compiling`` for PyTorch 2,
``model_cache``, ``model_package`` and ``package_cache`` for sharing one load, ``tensor_store`` and
``device_tensors`` for holding equal tensors once, ``lora`` and ``lora_layers`` for PEFT LoRA adapters over one
base, and ``sharing`` (which models share a device host).
It may import: ``base``, ``operations``.
"""
