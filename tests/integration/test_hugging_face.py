"""Hugging Face ``save_pretrained`` directories served with no code, through the real frontend: each task answers
what the transformers pipeline answers (the AWS Hugging Face container's contract), bad input is the client's 400,
the task and ``trust_remote_code`` rules hold, and the models share the device host."""

from __future__ import annotations

import base64
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hf_models
import pytest
import requests
from serving import RunningServer, batch_passes, start_server, wait_until

QUESTION = {"question": "what is the capital of france", "context": "paris is the capital of france and berlin is not"}


@pytest.fixture(scope="module")
def hf_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny models, built once: every test copies what it loads."""
    root = tmp_path_factory.mktemp("hf-models")
    for task in ("text-classification", "token-classification", "feature-extraction", "fill-mask"):
        hf_models.bert(root / task, task)
    hf_models.bert(root / "question-answering", "question-answering")
    hf_models.distilbert(root / "distilbert")
    hf_models.vit(root / "vit")
    return root


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, hf_root: Path) -> Iterator[RunningServer]:
    with start_server(tmp_path_factory.mktemp("hf-serving")) as running:
        for name in ("text-classification", "token-classification", "feature-extraction", "fill-mask"):
            shutil.copytree(hf_root / name, running.models / name)
        shutil.copytree(hf_root / "question-answering", running.models / "question-answering")
        shutil.copytree(hf_root / "distilbert", running.models / "distilbert")
        shutil.copytree(hf_root / "vit", running.models / "vit")
        running.load_all(sorted(path.name for path in running.models.iterdir()))
        yield running


def pipeline_answer(model_dir: Path, task: str, inputs: Any, **parameters: Any) -> Any:
    """What transformers' own pipeline answers, through JSON as a client receives it."""
    import transformers

    pipe = transformers.pipeline(task, model=str(model_dir))
    answer = pipe(inputs, **parameters)
    return json.loads(json.dumps(answer, default=lambda value: value.tolist() if hasattr(value, "tolist") else value))


close = hf_models.answers_close


def invoke(server: RunningServer, name: str, body: Any, **kwargs: Any) -> requests.Response:
    return server.invoke(name, json.dumps(body), **kwargs)


@pytest.mark.parametrize(
    ("task", "inputs", "parameters"),
    [
        ("text-classification", "good movie", {}),
        ("text-classification", ["good movie", "a terrible story that nobody liked"], {}),
        ("text-classification", "good movie", {"top_k": None}),
        ("token-classification", "paris is the capital of france", {}),
        ("token-classification", ["paris is the capital", "berlin"], {"aggregation_strategy": "simple"}),
        ("feature-extraction", "paris", {}),
        ("feature-extraction", ["paris is", "the capital of france"], {}),
        ("fill-mask", "paris is the [MASK] of france", {}),
        ("fill-mask", ["paris is the [MASK]", "the [MASK] of france"], {"top_k": 2}),
    ],
)
def test_each_task_answers_what_the_pipeline_answers(
    server: RunningServer, hf_root: Path, task: str, inputs: Any, parameters: dict[str, Any]
) -> None:
    body: dict[str, Any] = {"inputs": inputs, **({"parameters": parameters} if parameters else {})}
    response = invoke(server, task, body)
    assert response.status_code == 200, response.text
    assert response.headers["Content-Type"].startswith("application/json")
    assert close(response.json(), pipeline_answer(hf_root / task, task, inputs, **parameters))


def test_question_answering_answers_span_and_score(server: RunningServer) -> None:
    answer = invoke(server, "question-answering", {"inputs": QUESTION}).json()
    assert set(answer) == {"score", "start", "end", "answer"}
    assert QUESTION["context"][answer["start"] : answer["end"]] == answer["answer"]
    several = invoke(server, "question-answering", {"inputs": [QUESTION, QUESTION], "parameters": {"top_k": 2}})
    assert several.status_code == 200 and len(several.json()) == 2 and len(several.json()[0]) == 2


def test_image_classification_takes_an_image_body_or_base64(server: RunningServer, hf_root: Path) -> None:
    image = hf_models.png(3)
    raw = server.invoke("vit", image, content_type="image/png")
    assert raw.status_code == 200, raw.text
    import io

    from PIL import Image

    assert close(raw.json(), pipeline_answer(hf_root / "vit", "image-classification", Image.open(io.BytesIO(image))))
    encoded = invoke(server, "vit", {"inputs": base64.b64encode(image).decode()})
    assert encoded.status_code == 200 and close(encoded.json(), raw.json())


def test_csv_in_and_out_as_the_aws_container_takes_them(server: RunningServer) -> None:
    response = server.invoke("distilbert", "inputs\ngood movie\nbad film\n", content_type="text/csv", accept="text/csv")
    assert response.status_code == 200, response.text
    lines = response.text.strip().splitlines()
    assert lines[0] == "label,score" and len(lines) == 3


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({"text": "good"}, '"inputs"'),
        ({"inputs": 3}, "string"),
        ({"inputs": []}, "empty"),
        ({"inputs": "good", "parameters": "top_k=2"}, '"parameters"'),
        ({"inputs": "good", "parameters": {"return_tensors": True}}, "return_tensors"),
    ],
)
def test_bad_input_is_the_clients_400(server: RunningServer, body: dict[str, Any], fragment: str) -> None:
    response = invoke(server, "text-classification", body)
    assert response.status_code == 400, response.text
    assert fragment in response.json()["message"]
    assert "Traceback" not in response.text


@pytest.mark.parametrize(
    ("model", "body", "fragment"),
    [
        ("fill-mask", {"inputs": "no mask here"}, "could not be prepared"),
        ("fill-mask", {"inputs": "the [MASK]", "parameters": {"top_k": "abc"}}, "parameters"),
        ("token-classification", {"inputs": "paris", "parameters": {"ignore_labels": 5}}, "parameters"),
        ("question-answering", {"inputs": QUESTION, "parameters": {"top_k": 0}}, "top_k"),
    ],
)
def test_what_the_task_refuses_is_the_clients_400(
    server: RunningServer, model: str, body: dict[str, Any], fragment: str
) -> None:
    response = invoke(server, model, body)
    assert response.status_code == 400, response.text
    assert fragment in response.json()["message"]


def test_text_pairs_and_the_question_answering_parameters_of_transformers_4_are_taken(server: RunningServer) -> None:
    pair = invoke(server, "text-classification", {"inputs": {"text": "good movie", "text_pair": "bad film"}})
    assert pair.status_code == 200 and set(pair.json()[0] if isinstance(pair.json(), list) else pair.json()) == {
        "label",
        "score",
    }
    parameters = {"align_to_words": False, "max_question_len": 64, "padding": "longest"}
    answer = invoke(server, "question-answering", {"inputs": QUESTION, "parameters": parameters})
    assert answer.status_code == 200, answer.text


def test_an_image_over_25_megapixels_is_refused(server: RunningServer) -> None:
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("L", (6000, 5000)).save(buffer, format="PNG")
    response = server.invoke("vit", buffer.getvalue(), content_type="image/png")
    assert response.status_code == 400 and "pixels" in response.json()["message"]


def test_text_over_the_models_length_is_400_unless_truncated(server: RunningServer) -> None:
    long_text = hf_models.text_of_tokens(700, 1)
    refused = invoke(server, "text-classification", {"inputs": long_text})
    assert refused.status_code == 400 and "truncation" in refused.json()["message"]
    truncated = invoke(server, "text-classification", {"inputs": long_text, "parameters": {"truncation": True}})
    assert truncated.status_code == 200, truncated.text


def test_models_share_the_device_host(server: RunningServer) -> None:
    assert all(server.shares_device_host(name) for name in ("text-classification", "vit", "question-answering"))


def test_unsupported_or_unknown_task_fails_the_load_naming_what_is_supported(
    server: RunningServer, hf_root: Path
) -> None:
    for name, task, cause in (
        ("unknown", "translate-to-klingon", "task 'translate-to-klingon' is not served with no code"),
        ("generative", "text-generation", "whose weights lack what text-generation needs"),  # a classifier's head
    ):
        model = server.models / name
        shutil.copytree(hf_root / "text-classification", model)
        (model / "serving.properties").write_text(f"task={task}\n")
        response = server.load(name)
        assert response.status_code >= 400, response.text
        assert wait_until(lambda cause=cause: cause in server.log_text(), 10)
    assert "supported: text-classification, token-classification" in server.log_text()


def test_custom_code_runs_only_with_trust_remote_code(server: RunningServer, hf_root: Path) -> None:
    for name, trust in (("custom-refused", False), ("custom-trusted", True)):
        model = server.models / name
        shutil.copytree(hf_root / "text-classification", model)
        (model / "custom_bert.py").write_text(
            "from transformers import BertForSequenceClassification\n\n\n"
            "class CustomBert(BertForSequenceClassification):\n    pass\n"
        )
        config = json.loads((model / "config.json").read_text())
        config["auto_map"] = {"AutoModelForSequenceClassification": "custom_bert.CustomBert"}
        (model / "config.json").write_text(json.dumps(config))
        (model / "serving.properties").write_text(f"trust_remote_code={'true' if trust else 'false'}\n")
        response = server.load(name)
        if trust:
            assert response.status_code == 200, response.text
            assert invoke(server, name, {"inputs": "good"}).status_code == 200
        else:
            assert response.status_code >= 400
            assert wait_until(lambda: "it runs only with trust_remote_code=true" in server.log_text(), 10)
    assert "runs the code its config.json names (trust_remote_code=true)" in server.log_text()


def test_task_from_serving_properties_wins_over_the_architecture(server: RunningServer, hf_root: Path) -> None:
    model = server.models / "as-features"
    shutil.copytree(hf_root / "text-classification", model)
    (model / "serving.properties").write_text("task=feature-extraction\n")
    assert server.load("as-features").status_code == 200
    embedding = invoke(server, "as-features", {"inputs": "paris"}).json()
    assert isinstance(embedding[0][0], list)  # hidden states per token, not labels


def test_weights_saved_as_pytorch_model_bin_load_through_weights_only(server: RunningServer, hf_root: Path) -> None:
    import torch
    from safetensors.torch import load_file

    model = server.models / "bin-weights"
    shutil.copytree(hf_root / "text-classification", model)
    weights = model / "model.safetensors"
    torch.save(load_file(str(weights)), model / "pytorch_model.bin")
    weights.unlink()
    assert server.load("bin-weights").status_code == 200
    ours = invoke(server, "bin-weights", {"inputs": "good movie"}).json()
    assert close(ours, invoke(server, "text-classification", {"inputs": "good movie"}).json())


def test_sixteen_clients_of_mixed_lengths_share_passes_and_each_gets_its_own_answer(
    server: RunningServer, hf_root: Path
) -> None:
    """batch_size=16: texts of 1 to 200 tokens are padded into shared passes, and every client gets the logits the
    unbatched pipeline gives its own text (within 1e-4)."""
    from concurrent.futures import ThreadPoolExecutor

    model = server.models / "batched"
    shutil.copytree(hf_root / "text-classification", model)
    (model / "serving.properties").write_text("batch_size=16\nmax_batch_delay=50\n")
    assert server.load("batched").status_code == 200
    lengths = [1 + (index * 37) % 200 for index in range(64)]
    texts = [hf_models.text_of_tokens(length, seed) for seed, length in enumerate(lengths)]
    parameters = {"function_to_apply": "none", "top_k": None}  # every label's raw logit

    def ask(text: str) -> Any:
        response = invoke(server, "batched", {"inputs": text, "parameters": parameters})
        assert response.status_code == 200, response.text
        return response.json()

    with ThreadPoolExecutor(16) as clients:
        answers = list(clients.map(ask, texts))
    import transformers

    pipe = transformers.pipeline("text-classification", model=str(hf_root / "text-classification"))
    for text, answer in zip(texts, answers, strict=True):
        assert close(answer, pipe(text, **parameters)), text
    passes, batched_requests = batch_passes(server, "batched")
    # Requests shared passes. How many passes varies widely on the 2-core VM (7 to 46 for these 64 requests, 11 to
    # 32 before weights were shared): a bound at half the requests failed there now and then, so the bound is the
    # behaviour itself; benchmarks/batching.py and hugging_face.py measure how much batching gains.
    assert batched_requests == len(texts) and passes < len(texts), (passes, batched_requests)


def _maps_tokenizers(pid: int) -> bool:
    return "tokenizers.abi3.so" in Path(f"/proc/{pid}/maps").read_text()


def test_transformers_is_imported_by_the_first_such_model_and_a_requirements_txt_naming_it_shares(
    tmp_path: Path, hf_root: Path
) -> None:
    """Never at start: a container serving no such model never pays for transformers. A model whose
    requirements.txt names what the image ships keeps sharing the device host."""
    import psutil

    with start_server(tmp_path) as fresh:
        children = psutil.Process(fresh.process.pid).children()
        [warm] = [p for p in children if "mme_runtime.processes.warm_start" in " ".join(p.cmdline())]
        assert not _maps_tokenizers(warm.pid)
        model = fresh.models / "pinned"
        shutil.copytree(hf_root / "distilbert", model)
        (model / "code").mkdir()
        (model / "code" / "requirements.txt").write_text("transformers==5.23.0\ntokenizers\n")
        assert fresh.load("pinned").status_code == 200
        assert _maps_tokenizers(warm.pid)
        assert fresh.shares_device_host("pinned")
        assert invoke(fresh, "pinned", {"inputs": "good"}).status_code == 200


# The AWS Hugging Face toolkit's own examples (its tests/integ/config.py and the Hugging Face docs), and the shape of
# the answers it documents for them. The models here have random weights: the shapes, keys and types must match.
DOCUMENTED = [
    ("text-classification", {"inputs": "I love you. I like you"}, [{"label": str, "score": float}]),
    (
        "text-classification",
        {"inputs": "Don't waste your time.  We had two different people come."},
        [{"label": str, "score": float}],
    ),
    (
        "token-classification",
        {"inputs": "My name is Wolfgang and I live in Berlin"},
        [{"word": str, "score": float, "entity": str, "index": int, "start": int, "end": int}],
    ),
    (
        "question-answering",
        {
            "inputs": {
                "question": "What is used for inference?",
                "context": "My Name is Philipp and I live in Nuremberg. "
                "This model is used with sagemaker for inference.",
            }
        },
        {"score": float, "start": int, "end": int, "answer": str},
    ),
    (
        "fill-mask",
        {"inputs": "Paris is the [MASK] of France."},
        [{"score": float, "token": int, "token_str": str, "sequence": str}],
    ),
]


def _same_shape(answer: Any, documented: Any) -> bool:
    if isinstance(documented, dict):
        return (
            isinstance(answer, dict)
            and answer.keys() == documented.keys()
            and all(isinstance(answer[key], kind) for key, kind in documented.items())
        )
    return isinstance(answer, list) and bool(answer) and all(_same_shape(item, documented[0]) for item in answer)


@pytest.mark.parametrize(("task", "body", "documented"), DOCUMENTED, ids=[case[0] for case in DOCUMENTED])
def test_the_aws_containers_documented_examples_get_answers_of_its_shape(
    server: RunningServer, task: str, body: dict[str, Any], documented: Any
) -> None:
    response = invoke(server, task, body, accept="application/json")
    assert response.status_code == 200, response.text
    assert _same_shape(response.json(), documented), response.text
    if task == "fill-mask":
        assert len(response.json()) == 5


def test_the_aws_containers_feature_extraction_and_image_examples(server: RunningServer) -> None:
    vectors = invoke(server, "feature-extraction", {"inputs": "What is the best book."}).json()
    assert len(vectors) == 1 and all(len(token) == 32 for token in vectors[0])  # [1][tokens][hidden]
    labels = server.invoke("vit", hf_models.png(7), content_type="image/png").json()
    assert _same_shape(labels, [{"label": str, "score": float}])
