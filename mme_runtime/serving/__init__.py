"""One request, from the socket to ``predict_fn`` and back, in reading order: ``connection`` (MMS's messages on a
frontend connection, answered through ``handler_service.py``; a batching model's connections opened as its requests
overlap), ``transformer`` (the model's lifecycle), ``pipeline`` (each request through
the contract), ``contract`` (the user's functions over the defaults), ``batcher`` (one forward pass
for many requests; ``pass_threads`` runs a GPU's passes on a few threads), ``content`` (codecs, statuses and
error bodies), ``context`` (what user functions receive) and ``placement`` (the model on its
device). A Hugging Face model served with no code swaps the contract's defaults for ``hf_defaults``: ``hf_requests``
(the AWS Hugging Face container's request and answer), ``hf_tasks`` (a batch through the task's pipeline, with a
tokenizer lent by ``hf_tokenizer_copies``), ``hf_padding`` (rows grouped by length, padded and cut back),
``hf_question_answering``, ``hf_zero_shot`` (zero-shot's parameters), ``hf_tables`` (TAPAS), ``hf_vision`` (images
batched per shape), ``hf_sentences`` (sentence-transformers' tasks) and ``hf_npy`` (NPY bodies); its generative
tasks go through ``hf_generation`` (requests into rows and answers, with ``hf_generation_tasks``;
``hf_generation_parameters`` checks what a request asks of ``generate``), ``hf_scheduler`` (rows join and leave
between steps), ``hf_decoding`` (one step of every row, their caches padded together, kept by ``hf_kv_cache``) and
``hf_rows`` (how a row picks its token); its speech tasks through ``hf_audio`` (audio bodies decoded and resampled)
and ``hf_audio_tasks`` (clips padded into shared passes, Whisper's batched generate).
It may import: ``base``, ``operations``, ``models``.
"""
