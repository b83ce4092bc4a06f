"""A model as files become a model in memory: ``loading`` (the spec and the load), ``serving_properties``,
``user_code`` (with ``code_fetcher`` from S3 and ``dependencies``), ``pt2`` and ``compiling`` for PyTorch 2,
``model_cache``, ``model_package`` and ``package_cache`` for sharing one load, ``tensor_store`` and
``device_tensors`` for holding equal tensors once, ``lora`` and ``lora_layers`` for PEFT LoRA adapters over one
base, ``sharing`` (which models share a device host), and ``hf_loading`` for Hugging Face directories served with
no code (``hf_audio_loading`` for speech models, ``hf_sentence_loading`` for sentence-transformers ones,
``hf_shared_tokenizers`` for one tokenizer object per content).
It may import: ``base``, ``operations``.
"""
