"""A model as files become a model in memory: ``loading`` (the spec, which host a model needs, and
the load), ``serving_properties``, ``user_code`` (with ``code_fetcher`` from S3, and requirements),
``pt2`` for PyTorch 2 artifacts and ``compile=true``, ``model_package`` and ``package_cache`` for
sharing one load, ``tensor_store`` for holding equal tensors once (in host memory and on each card),
``lora`` for PEFT LoRA adapters and their base, and ``lora_layers`` for serving them row by
row over that one base.
It may import: ``base``, ``operations``.
"""
