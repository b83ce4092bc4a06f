"""PEFT LoRA adapters over a tiny BERT, made here (no hub), and what PEFT itself answers with each merged in."""

from __future__ import annotations

import functools
import shutil
import warnings
from pathlib import Path
from typing import Any

import hf_models
import torch

TARGETS = ("query", "value", "dense")


def base(directory: Path, task: str = "text-classification", hidden: int = 64) -> Path:
    return hf_models.bert(directory, task, hidden=hidden)


def adapter(
    base_dir: Path, directory: Path, seed: int, rank: int = 8, targets: tuple[str, ...] = TARGETS, **options: Any
) -> Path:
    """A LoRA adapter of ``base_dir``'s model: random B matrices (PEFT starts them at zero), and for a classifier its
    own head (PEFT's modules_to_save), saved as PEFT saves it."""
    import peft
    import transformers

    task_type = {"BertForSequenceClassification": "SEQ_CLS", "BertForTokenClassification": "TOKEN_CLS"}
    model = transformers.AutoModelForSequenceClassification.from_pretrained(str(base_dir))
    config = peft.LoraConfig(
        task_type=task_type[type(model).__name__],
        r=rank,
        lora_alpha=2 * rank,
        target_modules=list(targets),
        **options,
    )
    wrapped = peft.get_peft_model(model, config)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, parameter in wrapped.named_parameters():
            if "lora_" in name or "modules_to_save" in name:
                parameter.normal_(0, 0.5)
    wrapped.save_pretrained(str(directory))
    (directory / "README.md").unlink(missing_ok=True)
    return directory


def merged(base_dir: Path, adapter_dir: Path) -> Any:
    """PEFT's own model with the adapter merged into the base: the reference every answer is compared with."""
    import peft
    import transformers

    model = transformers.AutoModelForSequenceClassification.from_pretrained(str(base_dir))
    return peft.PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload().eval()


def ship_base_inside(base_dir: Path, adapter_dir: Path) -> None:
    """The base as a directory inside the adapter's: what one archive holding both unpacks to."""
    shutil.copytree(base_dir, adapter_dir / "base")


MLP_SCRIPT = """\
import torch


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 64)
        self.fc2 = torch.nn.Linear(64, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def model_fn(model_dir):
    model = MLP()
    model.load_state_dict(torch.load(f"{model_dir}/model.pth"))
    return model
"""


def mlp_base(directory: Path) -> Path:
    """A plain PyTorch base: a state dict and the inference.py whose model_fn builds the module."""
    (directory / "code").mkdir(parents=True)
    (directory / "code" / "inference.py").write_text(MLP_SCRIPT)
    torch.manual_seed(0)
    torch.save(_mlp_module(directory).state_dict(), directory / "model.pth")
    return directory


def _mlp_module(base_dir: Path) -> torch.nn.Module:
    namespace: dict[str, Any] = {}
    exec(compile((base_dir / "code" / "inference.py").read_text(), "inference.py", "exec"), namespace)  # noqa: S102
    model: torch.nn.Module = namespace["MLP"]()
    weights = base_dir / "model.pth"
    if weights.is_file():
        model.load_state_dict(torch.load(weights))
    return model.eval()


def mlp_adapter(base_dir: Path, directory: Path, seed: int) -> Path:
    """A LoRA adapter of the plain module, as PEFT saves one (no task type)."""
    import peft

    wrapped = peft.get_peft_model(
        _mlp_module(base_dir), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["fc1", "fc2"])
    )
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, parameter in wrapped.named_parameters():
            if "lora_" in name:
                parameter.normal_(0, 0.5)
    wrapped.save_pretrained(str(directory))
    (directory / "README.md").unlink(missing_ok=True)
    return directory


def mlp_merged(base_dir: Path, adapter_dir: Path) -> torch.nn.Module:
    import peft

    return peft.PeftModel.from_pretrained(_mlp_module(base_dir), str(adapter_dir)).merge_and_unload().eval()


# The linear layers of a Llama-style decoder layer: PEFT's "all linear layers" for these models.
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
ALL_LINEAR = (*ATTENTION, "gate_proj", "up_proj", "down_proj")


def causal_base(directory: Path, seed: int = 0, hidden: int = 64, layers: int = 2) -> Path:
    """A tiny Llama-shaped causal LM (grouped-query attention, rotary positions) with random weights and a
    byte-level BPE tokenizer trained here: the base of the generative adapters."""
    import transformers

    tokenizer, vocabulary = hf_models.gpt2_tokenizer(256)
    end = tokenizer.eos_token_id
    config = transformers.LlamaConfig(
        vocab_size=vocabulary,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=end,
        eos_token_id=end,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = hf_models._lively(transformers.LlamaForCausalLM(config), end, seed=seed, std=0.2)
    return hf_models._save(model, tokenizer, directory)


def causal_adapter(
    base_dir: Path,
    directory: Path,
    seed: int,
    rank: int = 8,
    targets: tuple[str, ...] = ALL_LINEAR,
    task_type: str = "CAUSAL_LM",
    **options: Any,
) -> Path:
    """A generative LoRA adapter (``CAUSAL_LM`` of ``causal_base``'s model, or ``SEQ_2_SEQ_LM`` of an
    encoder-decoder) with random A and B (and saved modules), as PEFT saves it."""
    import peft
    import transformers

    kind = transformers.AutoModelForCausalLM if task_type == "CAUSAL_LM" else transformers.AutoModelForSeq2SeqLM
    model = kind.from_pretrained(str(base_dir))
    options.setdefault("lora_alpha", 2 * rank)
    config = peft.LoraConfig(task_type=task_type, r=rank, target_modules=list(targets), **options)
    wrapped = peft.get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in wrapped.named_parameters():
            if "lora_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
            elif "modules_to_save" in name:
                parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.2)
    with warnings.catch_warnings():  # an embedding among the targets: PEFT says it saves the embedding too
        warnings.simplefilter("ignore", UserWarning)
        wrapped.save_pretrained(str(directory))
    (directory / "README.md").unlink(missing_ok=True)
    return directory


@functools.cache
def peft_causal(base_dir: Path, adapter_dir: Path | None) -> Any:
    """PEFT's model of the adapter over the base (None: the base alone), unmerged: the reference of generation."""
    import peft
    import transformers

    model: Any = transformers.AutoModelForCausalLM.from_pretrained(str(base_dir))
    if adapter_dir is not None:
        model = peft.PeftModel.from_pretrained(model, str(adapter_dir))
    return model.eval()


def peft_generate(model: Any, prompt: list[int], max_new_tokens: int, **parameters: Any) -> list[int]:
    """What PEFT's ``generate`` gives a prompt alone, greedy unless ``parameters`` say otherwise (``num_beams``), on the
    model's device: the new tokens."""
    ids = torch.tensor([prompt], device=next(model.parameters()).device)
    with torch.inference_mode():
        output = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            **{"do_sample": False, **parameters},
        )
    return list(output[0, len(prompt) :].tolist())


def peft_text(
    base_dir: Path,
    adapter_dir: Path | None,
    text: str,
    new_tokens: int,
    device: torch.device | None = None,
    **parameters: Any,
) -> str:
    """PEFT's generate for the text alone (None: the base's), greedy unless ``parameters`` say otherwise, on ``device``
    (the CPU by default), as the text-generation pipeline writes the answer."""
    tokenizer, model = _reference(base_dir, adapter_dir, device or torch.device("cpu"))
    prompt = tokenizer(text)["input_ids"]
    new = peft_generate(model, prompt, new_tokens, **parameters)
    full = tokenizer.decode(prompt + new, skip_special_tokens=True)
    return text + full[len(tokenizer.decode(prompt, skip_special_tokens=True)) :]


# peft_text's tokenizers and models, by the contents of their directories: a test checks dozens of answers against the
# same few models, and loading one cost about 0.2 s an answer.
_REFERENCES: dict[tuple[Any, ...], tuple[Any, Any]] = {}
KEPT_REFERENCES = 16


def _reference(base_dir: Path, adapter_dir: Path | None, device: torch.device) -> tuple[Any, Any]:
    import transformers

    key = (_contents(base_dir), _contents(adapter_dir), str(device))
    made = _REFERENCES.pop(key, None)
    if made is None:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(base_dir))
        made = tokenizer, peft_causal(base_dir, adapter_dir).to(device)
    _REFERENCES[key] = made  # the newest last
    while len(_REFERENCES) > KEPT_REFERENCES:
        del _REFERENCES[next(iter(_REFERENCES))]
    return made


def _contents(directory: Path | None) -> tuple[Any, ...] | None:
    """What a directory holds, by file name, size and modification time: another model is another key."""
    if directory is None:
        return None
    files = sorted(path for path in directory.iterdir() if path.is_file())
    return (str(directory), *((path.name, path.stat().st_size, path.stat().st_mtime_ns) for path in files))
