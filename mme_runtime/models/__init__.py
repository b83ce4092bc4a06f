"""A model as files becomes a model in memory: ``loading`` (the spec, which host a model needs, and the load),
``serving_properties``, ``user_code`` (with ``code_fetcher`` from S3, and requirements), ``pt2`` for PyTorch 2
artifacts and ``compile=true``, ``model_cache``, ``model_package`` and ``package_cache`` for sharing one load,
``tensor_store`` for holding equal tensors once (in host memory and on each card), ``lora`` for PEFT LoRA adapters
over one base, and ``hf_loading`` for Hugging Face directories served with no code (``hf_audio_loading`` for speech
models, ``hf_sentence_loading`` for sentence-transformers ones, ``hf_shared_tokenizers`` for one tokenizer object per
content).
It may import: ``base``, ``operations``.
"""
