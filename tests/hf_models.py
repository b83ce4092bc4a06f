"""Tiny Hugging Face models built offline, the way a user's ``save_pretrained`` leaves them: BERT-, DistilBERT- and
ViT-shaped configs with random weights, and a WordPiece tokenizer trained here on a small corpus. No hub, no network.
"""

from __future__ import annotations

import random
import shutil
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

WORDS = (
    "the a model serves many requests on one device while another waits for its turn and every client gets its own "
    "answer quickly because batching shares a forward pass between texts of different lengths padded to the longest "
    "one with an attention mask so that nothing leaks between rows of the batch what is the capital of france paris "
    "is the capital of france and berlin is the capital of germany good bad great terrible fine movie film story"
).split()
LABELS = {0: "NEGATIVE", 1: "POSITIVE"}
ENTITY_LABELS = {0: "O", 1: "B-LOC", 2: "I-LOC", 3: "B-PER", 4: "I-PER"}


def _transformers() -> Any:
    """transformers, without its progress bars (one per save is noise in test and script output)."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    return transformers


def in_threads(client: Callable[[Any], None], arguments: Iterable[Any]) -> None:
    """``client(argument)`` for each argument, each on a thread of its own, all at once; returns when all are done."""
    threads = [threading.Thread(target=client, args=(argument,)) for argument in arguments]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def corpus(lines: int = 400, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 30))) for _ in range(lines)]


def text_of_tokens(tokens: int, seed: int) -> str:
    """A text of about ``tokens`` words, all in the tokenizer's vocabulary."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(tokens))


def tokenizer(directory: Path, max_length: int = 512) -> None:
    """A WordPiece tokenizer trained on ``corpus()``, saved as a fast BERT tokenizer."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import BertTokenizerFast

    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    wordpiece = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    wordpiece.normalizer = normalizers.BertNormalizer(lowercase=True)
    wordpiece.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    wordpiece.train_from_iterator(
        corpus(), trainers.WordPieceTrainer(vocab_size=300, special_tokens=special, show_progress=False)
    )
    cls, sep = wordpiece.token_to_id("[CLS]"), wordpiece.token_to_id("[SEP]")
    wordpiece.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)]
    )
    BertTokenizerFast(tokenizer_object=wordpiece, model_max_length=max_length).save_pretrained(directory)


BERT_VOCABULARY = 30522  # entries in bert-base-uncased's vocabulary


def bert_sized_vocabulary(directory: Path, size: int = BERT_VOCABULARY) -> Path:
    """Grows the vocabulary of the tokenizer in ``directory`` (``tokenizer()``'s) to ``size`` entries with BERT's
    kind of filler (``[unused0]``, ...), so that it costs in memory what a real BERT tokenizer costs. Texts of
    ``corpus()`` tokenize as before (the pre-tokenizer splits off brackets: no word meets a filler) into ids below
    the model's ``vocab_size``."""
    import json

    path = directory / "tokenizer.json"
    data = json.loads(path.read_text())
    vocabulary = data["model"]["vocab"]
    for filler in range(size - len(vocabulary)):
        vocabulary[f"[unused{filler}]"] = len(vocabulary)
    path.write_text(json.dumps(data, ensure_ascii=False))
    return directory


def bert(
    directory: Path,
    task: str = "text-classification",
    layers: int = 2,
    hidden: int = 32,
    seed: int = 0,
    tokenizer_from: Path | None = None,
) -> Path:
    """A BERT-shaped model for ``task`` with random weights (the same for the same seed), and its tokenizer: trained
    here, or the files in ``tokenizer_from`` (training orders tied words differently from run to run)."""
    transformers = _transformers()

    torch.manual_seed(seed)
    config = transformers.BertConfig(
        vocab_size=300,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 32),
        intermediate_size=hidden * 2,
        max_position_embeddings=512,
        id2label=ENTITY_LABELS if task == "token-classification" else LABELS,
        label2id={v: k for k, v in (ENTITY_LABELS if task == "token-classification" else LABELS).items()},
    )
    classes = {
        "text-classification": transformers.BertForSequenceClassification,
        "token-classification": transformers.BertForTokenClassification,
        "feature-extraction": transformers.BertModel,
        "fill-mask": transformers.BertForMaskedLM,
        "question-answering": transformers.BertForQuestionAnswering,
    }
    classes[task](config).eval().save_pretrained(directory)
    if tokenizer_from is None:
        tokenizer(directory)
    else:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tokenizer_from / name, directory / name)
    return directory


def distilbert(directory: Path, seed: int = 0) -> Path:
    transformers = _transformers()

    torch.manual_seed(seed)
    config = transformers.DistilBertConfig(
        vocab_size=300,
        dim=32,
        n_layers=2,
        n_heads=2,
        hidden_dim=64,
        id2label=LABELS,
        label2id={"NEGATIVE": 0, "POSITIVE": 1},
    )
    transformers.DistilBertForSequenceClassification(config).eval().save_pretrained(directory)
    tokenizer(directory)
    return directory


def vit(directory: Path, seed: int = 0) -> Path:
    transformers = _transformers()

    torch.manual_seed(seed)
    config = transformers.ViTConfig(
        image_size=32,
        patch_size=8,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        id2label={0: "cat", 1: "dog", 2: "bird"},
        label2id={"cat": 0, "dog": 1, "bird": 2},
    )
    transformers.ViTForImageClassification(config).eval().save_pretrained(directory)
    transformers.ViTImageProcessor(size={"height": 32, "width": 32}).save_pretrained(directory)
    return directory


def png(seed: int, size: int = 48) -> bytes:
    """A small random RGB image, PNG-encoded, as a client would send it."""
    import io

    from PIL import Image

    rng = random.Random(seed)
    image = Image.new("RGB", (size, size))
    image.putdata([(rng.randrange(256), rng.randrange(256), rng.randrange(256)) for _ in range(size * size)])
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def fine_tune(base: Path, directory: Path, seed: int) -> Path:
    """``base`` (a text classifier) with its classifier head drawn anew: every other tensor is the base's, byte for
    byte, in files of its own."""
    transformers = _transformers()
    model = transformers.AutoModelForSequenceClassification.from_pretrained(str(base))
    torch.manual_seed(seed)
    with torch.no_grad():
        model.classifier.weight.normal_(0, 1)
        model.classifier.bias.normal_(0, 1)
    model.save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(base / name, directory / name)
    return directory


def _byte_bpe(specials: list[str], size: int = 400) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A byte-level BPE (GPT-2's and BART's kind) trained on ``corpus()``: its vocabulary and merges."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=size, special_tokens=specials, initial_alphabet=alphabet, show_progress=False
    )
    bpe.train_from_iterator(corpus(), trainer)
    data = json.loads(bpe.to_str())["model"]
    return data["vocab"], [tuple(merge) for merge in data["merges"]]


def gpt2_tokenizer(model_max_length: int) -> tuple[Any, int]:
    """A GPT-2 tokenizer over a byte-level BPE trained here, ``<|endoftext|>`` its one special token, and its
    vocabulary's size: the decoders' tokenizer."""
    vocab, merges = _byte_bpe(["<|endoftext|>"])
    tokenizer = _transformers().GPT2Tokenizer(vocab=vocab, merges=merges, model_max_length=model_max_length)
    return tokenizer, len(vocab)


def _unigram(specials: list[str], size: int = 300) -> list[tuple[str, float]]:
    """A SentencePiece-style unigram vocabulary (T5's and Marian's kind) trained on ``corpus()``."""
    import json

    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    unigram = Tokenizer(models.Unigram())
    unigram.normalizer = normalizers.NFKC()
    unigram.pre_tokenizer = pre_tokenizers.Metaspace()
    unigram.decoder = decoders.Metaspace()
    trainer = trainers.UnigramTrainer(vocab_size=size, special_tokens=specials, unk_token="<unk>", show_progress=False)
    unigram.train_from_iterator(corpus(), trainer)
    return [(piece, score) for piece, score in json.loads(unigram.to_str())["model"]["vocab"]]


def _lively(model: Any, *rare: int, scale: float = 0.5, seed: int = 0, std: float = 0.3) -> Any:
    """Random weights drawn wider than transformers draws them (``std``), so that what a small model generates
    depends on its input instead of repeating one token; ``rare`` tokens (the end token; a T5's padding, which it
    would pick every time) have their output rows scaled down by ``scale``, so generations run longer."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() >= 2:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * std)
        for token in rare:
            model.get_output_embeddings().weight[token] *= scale
    return model.eval()


def _save(model: Any, tokenizer: Any, directory: Path) -> Path:
    """Saved as ``save_pretrained`` leaves them, readable by transformers 4 too (the AWS container's): its
    tokenizer_config.json without transformers 5's empty ``extra_special_tokens`` list, which 4.57 reads as a dict."""
    import json

    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    path = directory / "tokenizer_config.json"
    config = json.loads(path.read_text())
    if config.get("extra_special_tokens") == []:
        del config["extra_special_tokens"]
        path.write_text(json.dumps(config, indent=2))
    return directory


def gpt2(directory: Path, layers: int = 2, hidden: int = 64, seed: int = 0, positions: int = 512) -> Path:
    """A GPT-2-shaped causal LM with random weights and a byte-level BPE tokenizer trained here."""
    transformers = _transformers()

    tokenizer, vocabulary = gpt2_tokenizer(positions)
    torch.manual_seed(seed)
    end = tokenizer.eos_token_id
    config = transformers.GPT2Config(
        vocab_size=vocabulary,
        n_positions=positions,
        n_embd=hidden,
        n_layer=layers,
        n_head=max(1, hidden // 32),
        bos_token_id=end,
        eos_token_id=end,
    )
    model = _lively(transformers.GPT2LMHeadModel(config), end, seed=seed)
    return _save(model, tokenizer, directory)


def t5(directory: Path, layers: int = 2, hidden: int = 64, seed: int = 0) -> Path:
    """A T5-shaped encoder-decoder with random weights, a unigram tokenizer trained here, and T5's
    ``task_specific_params`` (its ``summarize:`` and ``translate English to German:`` prefixes)."""
    transformers = _transformers()

    tokenizer = transformers.T5Tokenizer(vocab=_unigram(["<pad>", "</s>", "<unk>"]), extra_ids=0, model_max_length=512)
    torch.manual_seed(seed)
    config = transformers.T5Config(
        vocab_size=len(tokenizer),
        d_model=hidden,
        d_kv=32,
        d_ff=hidden * 2,
        num_layers=layers,
        num_heads=max(1, hidden // 32),
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
        task_specific_params={
            "summarization": {"prefix": "summarize: ", "max_length": 60},
            "translation_en_to_de": {"prefix": "translate English to German: ", "max_length": 60},
        },
    )
    model = _lively(transformers.T5ForConditionalGeneration(config), 1, seed=seed, std=1.0)
    with torch.no_grad():
        model.lm_head.weight[0] = 0.0  # padding: never generated
    return _save(model, tokenizer, directory)


# The decoder families people serve, as tiny models: grouped-query attention (4 heads, 2 of keys and values), rotary
# positions, tied or untied embeddings, and sliding windows where the family has them (SLIDING_WINDOW tokens, shorter
# than the tests' rows, so that the window cuts).
DECODER_FAMILIES = ("llama", "mistral", "qwen2", "gemma", "gemma2", "gemma3")
SLIDING_WINDOW = 12


def decoder(
    directory: Path, family: str = "llama", dtype: str = "float32", seed: int = 0, positions: int = 512
) -> Path:
    """A decoder-only model of ``family`` (``DECODER_FAMILIES``) with random weights saved in ``dtype`` (config.json
    says so), and a byte-level BPE tokenizer trained here that starts each text with ``<s>``, as Llama's does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    transformers = _transformers()
    vocab, merges = _byte_bpe(["<s>", "</s>", "<pad>"])
    bpe = Tokenizer(models.BPE(vocab, merges))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", pad_token="<pad>", model_max_length=positions
    )
    common = {
        "vocab_size": len(vocab),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": positions,
        "bos_token_id": vocab["<s>"],
        "eos_token_id": vocab["</s>"],
        "pad_token_id": vocab["<pad>"],
    }
    gemma = {"head_dim": 16, "query_pre_attn_scalar": 16}
    window = {"sliding_window": SLIDING_WINDOW}
    configs = {
        "llama": lambda: transformers.LlamaConfig(**common, tie_word_embeddings=False),
        "mistral": lambda: transformers.MistralConfig(**common, **window),
        # Qwen2's first max_window_layers layers attend to everything, the others within the window
        "qwen2": lambda: transformers.Qwen2Config(
            **common, **window, use_sliding_window=True, max_window_layers=1, tie_word_embeddings=True
        ),
        "gemma": lambda: transformers.GemmaConfig(**common, head_dim=16),
        "gemma2": lambda: transformers.Gemma2Config(**common, **gemma, **window),  # sliding, then full
        "gemma3": lambda: transformers.Gemma3TextConfig(**common, **gemma, **window, sliding_window_pattern=2),
    }
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(configs[family]())
    model = _lively(model, common["eos_token_id"], seed=seed)
    if family.startswith("gemma"):
        # Gemma multiplies its embeddings by sqrt(hidden_size) and ties them to its output: drawn this wide, each
        # input token would outweigh the layers and be generated again and again.
        with torch.no_grad():
            model.get_input_embeddings().weight.mul_(0.02)
    return _save(model.to(getattr(torch, dtype)), tokenizer, directory)


# The size of the tiny BART- and Marian-shaped models: two layers each side, 64 wide, 256 positions.
SMALL_ENCODER_DECODER = {
    "d_model": 64,
    "encoder_layers": 2,
    "decoder_layers": 2,
    "encoder_attention_heads": 2,
    "decoder_attention_heads": 2,
    "encoder_ffn_dim": 128,
    "decoder_ffn_dim": 128,
    "max_position_embeddings": 256,
}


def bart(directory: Path, seed: int = 0) -> Path:
    """A BART-shaped encoder-decoder (learned absolute positions) with a byte-level BPE tokenizer trained here."""
    transformers = _transformers()

    vocab, merges = _byte_bpe(["<s>", "<pad>", "</s>", "<unk>", "<mask>"])
    tokenizer = transformers.BartTokenizer(vocab=vocab, merges=merges, model_max_length=256)
    torch.manual_seed(seed)
    config = transformers.BartConfig(
        vocab_size=len(vocab),
        **SMALL_ENCODER_DECODER,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=2,
        forced_eos_token_id=2,
    )
    model = _lively(transformers.BartForConditionalGeneration(config), 2, seed=seed, std=1.0)
    return _save(model, tokenizer, directory)


def marian(directory: Path, seed: int = 0) -> Path:
    """A Marian-shaped translation model (sinusoidal positions) with a unigram tokenizer trained here: Marian's own
    tokenizer needs sentencepiece model files, so this one is a fast tokenizer with Marian's special tokens."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    transformers = _transformers()
    pieces = _unigram(["</s>", "<unk>", "<pad>"])
    unigram = Tokenizer(models.Unigram(pieces, unk_id=1))
    unigram.normalizer = normalizers.NFKC()
    unigram.pre_tokenizer = pre_tokenizers.Metaspace()
    unigram.decoder = decoders.Metaspace()
    unigram.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 0)])
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=unigram, eos_token="</s>", unk_token="<unk>", pad_token="<pad>", model_max_length=256
    )
    torch.manual_seed(seed)
    config = transformers.MarianConfig(
        vocab_size=len(pieces),
        **SMALL_ENCODER_DECODER,
        pad_token_id=2,
        eos_token_id=0,
        decoder_start_token_id=2,
        forced_eos_token_id=0,
    )
    model = _lively(transformers.MarianMTModel(config), 0, seed=seed, std=1.0)
    return _save(model, tokenizer, directory)


def llama(
    directory: Path,
    hidden: int = 64,
    layers: int = 2,
    intermediate: int = 128,
    heads: int = 2,
    kv_heads: int = 1,
    seed: int = 0,
) -> Path:
    """A Llama-shaped causal LM (grouped-query attention, rotary positions, untied embeddings) of any size, with
    random weights and a byte-level BPE tokenizer trained here. Tokens the corpus never uses are scaled down in the
    output layer (by 0.1), so that greedy text is made of the corpus's word pieces rather than stray bytes, which
    transformers 4 and 5 may cut differently at the prompt's end (lora_models.causal_base is the tests' tiny one)."""
    transformers = _transformers()

    tokenizer, vocabulary = gpt2_tokenizer(512)
    end = tokenizer.eos_token_id
    config = transformers.LlamaConfig(
        vocab_size=vocabulary,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=512,
        bos_token_id=end,
        eos_token_id=end,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = _lively(transformers.LlamaForCausalLM(config), end, seed=seed)
    used = {token for line in corpus() for token in tokenizer(" " + line)["input_ids"]}
    with torch.no_grad():
        model.lm_head.weight[[token for token in range(vocabulary) if token not in used | {end}]] *= 0.1
    return _save(model, tokenizer, directory)


def answers_close(ours: Any, theirs: Any, tolerance: float = 1e-4) -> bool:
    """Two answers alike: numbers within ``tolerance``, texts, labels and structure exactly."""
    if isinstance(ours, dict):
        return (
            isinstance(theirs, dict)
            and ours.keys() == theirs.keys()
            and all(answers_close(ours[k], theirs[k], tolerance) for k in ours)
        )
    if isinstance(ours, list):
        return (
            isinstance(theirs, list)
            and len(ours) == len(theirs)
            and all(answers_close(a, b, tolerance) for a, b in zip(ours, theirs, strict=True))
        )
    if isinstance(ours, float) or isinstance(theirs, float):
        return abs(float(ours) - float(theirs)) <= tolerance
    return bool(ours == theirs)
